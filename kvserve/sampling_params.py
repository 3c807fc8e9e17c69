"""SamplingParams: how one request's tokens are chosen, when it stops and what comes back (vLLM's fields)."""

from __future__ import annotations

import copy
import enum
import logging
import math
from dataclasses import dataclass, field

from kvserve.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
# Below this, softmax(logits / t) overflows to inf/nan in half precision; vLLM raises it to this.
_MIN_RANDOM_TEMPERATURE = 1e-2
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


def _check_types(p) -> None:
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


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per generated token; -1: the whole vocabulary
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        _check_types(self)  # before normalising: a wrong type must not be coerced into a right one
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None
        if self.logit_bias is not None:
            # JSON object keys arrive as strings.
            self.logit_bias = {_token_key(tok): _real("logit_bias", bias) for tok, bias in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}.")
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)
        self._validate()
        if 0 < self.temperature < _MIN_RANDOM_TEMPERATURE:
            logger.warning("temperature %s is below %s, which risks inf/nan; using %s.",
                           self.temperature, _MIN_RANDOM_TEMPERATURE, _MIN_RANDOM_TEMPERATURE)
            self.temperature = _MIN_RANDOM_TEMPERATURE
        if self.is_greedy:
            # Filters cannot change an argmax: turn them off so the batch can take the greedy fast path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        # Filled in by the engine when the request is added (they need the model and tokenizer).
        self._all_stop_token_ids: set[int] = set(self.stop_token_ids)
        self._bad_words_token_ids: list[list[int]] = []

    def _validate(self) -> None:
        def bad(name: str, msg: str):
            raise ValueError(f"{name} {msg}")

        if self.n < 1:
            bad("n", f"must be an integer of at least 1, got {self.n!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                bad(name, f"must be in [-2, 2], got {value}.")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] "
                                      f"(1 is off), got {self.repetition_penalty}.")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE}], got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if not 0 <= self.top_k <= INT64_MAX:
            bad("top_k", f"must be 0 or -1 (off) or a positive integer, got {self.top_k!r}.")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            bad("seed", f"must be a signed 64-bit integer (in [-2**63, 2**63 - 1]), got {self.seed}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < -1:
                bad(name, f"must be a non-negative integer or -1 (the whole vocabulary), got {value}.")
        if not all(_is_int(t) for t in self.stop_token_ids):
            bad("stop_token_ids", f"must contain only integers, got {self.stop_token_ids}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", f"must be non-empty strings, got {self.stop}.")
        if self.stop and not self.detokenize:
            bad("stop", "strings need detokenize=True (they are matched on the text).")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words", f"must be non-empty strings, got {self.bad_words}.")
        for name in ("stop", "bad_words"):
            if any(not _is_utf8(s) for s in getattr(self, name)):
                bad(name, "must be valid Unicode text (no lone surrogates).")
        if self.logit_bias is not None and not all(-100 <= b <= 100 for b in self.logit_bias.values()):
            bad("logit_bias", "values must be finite numbers in [-100, 100].")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty (leave it unset to allow every token).")
            if not all(_is_int(t) for t in self.allowed_token_ids):
                bad("allowed_token_ids", f"must contain only integers, got {self.allowed_token_ids[:5]}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", f"must be a RequestOutputKind, got {self.output_kind!r}.")

    def verify_for_model(self, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                         max_n: int = DEFAULT_MAX_N) -> None:
        """The limits that depend on the model and the operator's flags (--max-logprobs, --max-n). The engine
        calls this for every request it adds; the server calls it too, to answer 400 before the engine."""
        if self.n > max_n:
            raise ValueError(f"n must be at most {max_n} (--max-n), got {self.n}.")
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be -1, 0 or at most the vocabulary size {vocab_size}, got {self.top_k}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None or max_logprobs == -1:
                continue
            if value == -1:
                raise ValueError(f"{name} must be at most {max_logprobs} (--max-logprobs); -1 (the whole "
                                 f"vocabulary) needs --max-logprobs -1.")
            if value > max_logprobs:
                raise ValueError(f"{name} must be at most {max_logprobs} (--max-logprobs), got {value}.")
        self.verify_token_ids(vocab_size)

    # ---- derived ----------------------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_output_history(self) -> bool:
        """Sampling reads the tokens generated so far (penalties, bad words): the host must know them all,
        so a step for this request is not scheduled before the previous step's tokens are back."""
        return self.uses_penalties or bool(self.bad_words)

    @property
    def all_stop_token_ids(self) -> set[int]:
        """EOS and stop_token_ids: what min_tokens keeps from being sampled."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a stream holds back: they could be the start of a stop string (cut from the text)."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    # ---- resolved against the model when the request is added -----------------------------------
    def update_from_model(self, eos_token_id: int | None, extra_eos_token_ids=()) -> None:
        """EOS always counts for min_tokens; a model's other EOS ids stop like stop_token_ids (vLLM)."""
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)
        extra = [t for t in extra_eos_token_ids if t != eos_token_id]
        self._all_stop_token_ids.update(extra)
        if extra and not self.ignore_eos:
            self.stop_token_ids = list(dict.fromkeys([*self.stop_token_ids, *extra]))

    def update_from_tokenizer(self, tokenizer) -> None:
        """Token ids of each bad word, as it would appear at the start of text and after a space."""
        self._bad_words_token_ids = []
        for word in self.bad_words:
            variants = []
            for prefix in ("", " "):
                ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
                if ids and ids not in variants:
                    variants.append(ids)
            self._bad_words_token_ids.extend(variants)

    def verify_token_ids(self, vocab_size: int) -> None:
        def check(name: str, ids) -> None:
            out = [t for t in ids if not 0 <= t < vocab_size]
            if out:
                raise ValueError(
                    f"{name} contains out-of-vocabulary token id(s) {out[:5]} (vocabulary size {vocab_size}).")

        check("logit_bias", self.logit_bias or ())
        check("allowed_token_ids", self.allowed_token_ids or ())
        check("stop_token_ids", self.stop_token_ids)
