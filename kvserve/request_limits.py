"""The one request validator: every limit on what one request may ask, each checked in one function here.

The server and the library both run a request through `validate_request` exactly once: the server before
the request reaches the engine (so a refusal is a 400 and nothing was queued), the library in
LLMEngine.add_request for prompts that arrive unchecked (`LLM`, direct engine users). A request the
server validated travels as a ValidatedPrompt, which the engine takes as it is. SamplingParams runs the
field checks (types, list caps, ranges) when it is built, as vLLM's does. Pure Python, no torch.

What is not here: the server's admission limits (fan-out per request, waiting queue: an operator's
limits on HTTP traffic, entrypoints/openai/admission.py), the HTTP body limits (http_limits.py), and the
scheduler's own check that a prompt fits its KV cache and its step budget (facts of the running engine,
core/scheduler.py `check_fits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Ranges beyond vLLM's "> 0": past them a value only makes logits overflow (OpenAI's own maximum is 2).
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds, as vLLM: what a torch generator and numpy accept
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs
DEFAULT_MAX_N = 128  # OpenAI's limit on n
# Longest list each field may hold: every sample gets its own copy, and sampling or stop checks read it
# every step. Generous for real use (allowed_token_ids: any vocabulary), far below what stalls an engine.
MAX_LIST_LENGTHS = {
    "stop": 256,
    "stop_token_ids": 4096,
    "bad_words": 4096,
    "logit_bias": 16384,
    "allowed_token_ids": 262144,
}
MAX_STOP_STRING_CHARS = 1024  # a stream holds back this many characters, in case a stop string starts there


# The type each field must have: a JSON true is not a number, a string is not a boolean.
_INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed")
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "detokenize", "skip_special_tokens",
                "spaces_between_special_tokens")
_OPTIONAL = ("max_tokens", "logprobs", "prompt_logprobs", "seed")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _real(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(x).__name__} {x!r}.")
    try:
        value = float(x)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got {x}.") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {x}.")
    return value


def _token_key(tok) -> int:
    """A logit_bias key: a token id, or its decimal string (JSON object keys are strings)."""
    if _is_int(tok):
        return tok
    if isinstance(tok, str) and len(tok) <= 20 and tok.strip().lstrip("-").isdigit():
        return int(tok)
    raise ValueError(f"logit_bias keys must be token ids, got {str(tok)[:40]!r}.")


def check_field_types(p) -> None:
    """Each field's type, and the list caps (SamplingParams runs this first, before normalising)."""
    for name in _INT_FIELDS:
        value = getattr(p, name)
        if value is None and name in _OPTIONAL:
            continue
        if not _is_int(value):
            raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}.")
    for name in _FLOAT_FIELDS:
        _real(name, getattr(p, name))
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name} must be a boolean, got {type(getattr(p, name)).__name__}.")
    if p.logit_bias is not None and not isinstance(p.logit_bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {type(p.logit_bias).__name__}.")
    for name in ("stop_token_ids", "bad_words", "allowed_token_ids"):
        value = getattr(p, name)
        if value is not None and not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {type(value).__name__}.")
    if p.stop is not None and not isinstance(p.stop, (str, list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(p.stop).__name__}.")
    for name, limit in MAX_LIST_LENGTHS.items():
        value = getattr(p, name)
        if value is not None and not isinstance(value, str) and len(value) > limit:
            raise ValueError(f"{name} may hold at most {limit} entries, got {len(value)}.")
    for stop in [p.stop] if isinstance(p.stop, str) else (p.stop or ()):
        if isinstance(stop, str) and len(stop) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters, got {len(stop)}.")


# ---- sampling fields ---------------------------------------------------------------------------------
def check_sampling_ranges(p) -> None:
    """Each sampling field within its range (SamplingParams runs this when it is built)."""
    def bad(name: str, msg: str):
        raise ValueError(f"{name} {msg}")

    if p.n < 1:
        bad("n", f"must be an integer of at least 1, got {p.n!r}.")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -2.0 <= value <= 2.0:
            bad(name, f"must be in [-2, 2], got {value}.")
    if not MIN_REPETITION_PENALTY <= p.repetition_penalty <= MAX_REPETITION_PENALTY:
        bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] "
                                  f"(1 is off), got {p.repetition_penalty}.")
    if not 0 <= p.temperature <= MAX_TEMPERATURE:
        bad("temperature", f"must be in [0, {MAX_TEMPERATURE}], got {p.temperature}.")
    if not 0 < p.top_p <= 1:
        bad("top_p", f"must be in (0, 1], got {p.top_p}.")
    if not 0 <= p.top_k <= INT64_MAX:
        bad("top_k", f"must be 0 or -1 (off) or a positive integer, got {p.top_k!r}.")
    if not 0 <= p.min_p <= 1:
        bad("min_p", f"must be in [0, 1], got {p.min_p}.")
    if p.seed is not None and not INT64_MIN <= p.seed <= INT64_MAX:
        bad("seed", f"must be a signed 64-bit integer (in [-2**63, 2**63 - 1]), got {p.seed}.")
    if p.max_tokens is not None and p.max_tokens < 1:
        bad("max_tokens", f"must be at least 1, got {p.max_tokens}.")
    if p.min_tokens < 0:
        bad("min_tokens", f"must be greater than or equal to 0, got {p.min_tokens}.")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        bad("min_tokens", f"must be less than or equal to max_tokens={p.max_tokens}, got {p.min_tokens}.")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None and value < -1:
            bad(name, f"must be a non-negative integer or -1 (the whole vocabulary), got {value}.")
    if not all(_is_int(t) for t in p.stop_token_ids):
        bad("stop_token_ids", f"must contain only integers, got {p.stop_token_ids}.")
    if any(not isinstance(s, str) or not s for s in p.stop):
        bad("stop", f"must be non-empty strings, got {p.stop}.")
    if p.stop and not p.detokenize:
        bad("stop", "strings need detokenize=True (they are matched on the text).")
    if any(not isinstance(w, str) or not w.strip() for w in p.bad_words):
        bad("bad_words", f"must be non-empty strings, got {p.bad_words}.")
    for name in ("stop", "bad_words"):
        if any(not _is_utf8(s) for s in getattr(p, name)):
            bad(name, "must be valid Unicode text (no lone surrogates).")
    if p.logit_bias is not None and not all(-100 <= b <= 100 for b in p.logit_bias.values()):
        bad("logit_bias", "values must be finite numbers in [-100, 100].")
    if p.allowed_token_ids is not None:
        if not p.allowed_token_ids:
            bad("allowed_token_ids", "must not be empty (leave it unset to allow every token).")
        if not all(_is_int(t) for t in p.allowed_token_ids):
            bad("allowed_token_ids", f"must contain only integers, got {p.allowed_token_ids[:5]}.")


def check_for_model(p, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                    max_n: int = DEFAULT_MAX_N) -> None:
    """The limits that depend on the model and the operator's flags (--max-logprobs, --max-n)."""
    if p.n > max_n:
        raise ValueError(f"n must be at most {max_n} (--max-n), got {p.n}.")
    if p.top_k > vocab_size:
        raise ValueError(f"top_k must be -1, 0 or at most the vocabulary size {vocab_size}, got {p.top_k}.")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is None or max_logprobs == -1:
            continue
        if value == -1:
            raise ValueError(f"{name} must be at most {max_logprobs} (--max-logprobs); -1 (the whole "
                             f"vocabulary) needs --max-logprobs -1.")
        if value > max_logprobs:
            raise ValueError(f"{name} must be at most {max_logprobs} (--max-logprobs), got {value}.")
    check_token_id_fields(p, vocab_size)


def check_token_id_fields(p, vocab_size: int) -> None:
    """logit_bias, allowed_token_ids and stop_token_ids name tokens of the vocabulary."""
    def check(name: str, ids) -> None:
        out = [t for t in ids if not 0 <= t < vocab_size]
        if out:
            raise ValueError(
                f"{name} contains out-of-vocabulary token id(s) {out[:5]} (vocabulary size {vocab_size}).")

    check("logit_bias", p.logit_bias or ())
    check("allowed_token_ids", p.allowed_token_ids or ())
    check("stop_token_ids", p.stop_token_ids)


# ---- the prompt and the context ---------------------------------------------------------------------
@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the engine configuration's facts and the operator's flags."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_n: int = DEFAULT_MAX_N

    @classmethod
    def from_config(cls, config) -> RequestLimits:
        """From an EngineConfig (read by attribute, so this module needs no import of it)."""
        args = config.args
        return cls(config.max_model_len, config.model_config.vocab_size,
                   getattr(args, "max_logprobs", DEFAULT_MAX_LOGPROBS), getattr(args, "max_n", DEFAULT_MAX_N))


@dataclass(frozen=True)
class ValidatedPrompt:
    """A prompt that `validate_request` passed, with its text (None for token ids) and its token ids."""

    text: str | None
    token_ids: list[int]


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """At least one token, every id in the vocabulary (a prompt's, or the ids the server detokenizes)."""
    if not token_ids:
        raise ValueError("The prompt is empty: give at least one token.")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"Token id {bad[0]} is out of vocabulary (size {vocab_size}).")


def check_prompt_tokens(token_ids: list[int], limits: RequestLimits) -> None:
    """Valid token ids, no longer than the context."""
    check_token_ids(token_ids, limits.vocab_size)
    check_prompt_length(len(token_ids), limits.max_model_len)


def check_prompt_length(num_prompt: int, max_model_len: int) -> None:
    """No longer than the context. The scheduler asks it too of every request it is given (its core
    invariant, for its direct users), so the limit lives here alone."""
    if num_prompt > max_model_len:
        raise ValueError(context_exceeded(max_model_len, num_prompt))


def context_exceeded(limit: int, num_prompt: int) -> str:
    """vLLM's message for a prompt that leaves no room in the context."""
    return (f"This model's maximum context length is {limit} tokens (the maximum model length, max_model_len). "
            f"However, your request has "
            f"{num_prompt} input tokens. Please reduce the length of the input messages.")


def resolve_max_tokens(num_prompt: int, max_tokens: int | None, limits: RequestLimits,
                       default_max_tokens: int | None = None) -> int:
    """The OpenAI API's rule (vLLM's server): prompt + max_tokens must fit the context, and an unset
    max_tokens takes what is left of it, capped by the generation config's max_new_tokens. The library
    does not apply it: there, as in vLLM's LLM, a request simply stops at max_model_len."""
    limit = limits.max_model_len
    check_prompt_length(num_prompt, limit)  # a prompt too long alone is refused as the library refuses it
    if max_tokens is None:
        if num_prompt >= limit:
            raise ValueError(context_exceeded(limit, num_prompt))
        return min(limit - num_prompt, default_max_tokens or limit)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
    if num_prompt + max_tokens > limit:
        raise ValueError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the completion). "
            f"Please reduce the length of the messages or completion.")
    return max_tokens


def validate_request(text: str | None, token_ids: list[int], params, limits: RequestLimits) -> ValidatedPrompt:
    """Every check of one request against the model and the operator's limits, run once per request."""
    check_prompt_tokens(token_ids, limits)
    check_for_model(params, limits.vocab_size, limits.max_logprobs, limits.max_n)
    return ValidatedPrompt(text, token_ids)


# ---- structured outputs and tools -----------------------------------------------------------------------
# A grammar's compile time and memory grow with its size, so a size cap plus a compile timeout is what keeps
# one pathological schema from stalling the server.
MAX_SPEC_CHARS = 64 * 1024  # a JSON schema, regex, grammar or structural tag, as text
MAX_TOOLS = 128  # tools in one chat request


def check_spec_size(name: str, spec: str) -> None:
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"{name} is {len(spec)} characters long, more than the limit of {MAX_SPEC_CHARS}; "
                         f"send a smaller schema or grammar.")


def check_num_tools(num_tools: int) -> None:
    if num_tools > MAX_TOOLS:
        raise ValueError(f"tools has {num_tools} entries, more than the limit of {MAX_TOOLS}.")
