"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extra sampling fields.

Unknown fields are accepted, as by vLLM and OpenAI, so newer clients keep working, and logged once per name;
fields kvserve does not apply are refused or logged by request_fields.py. Types are strict (a JSON
true is not a number, "yes" is not a boolean, 1.0 is not an integer), floats must be finite, and every
string anywhere in a body must be valid Unicode (no lone surrogates, which JSON's \\ud800 escapes can carry).
Range checks and the operator's limits (--max-n, --max-logprobs) are SamplingParams' (one source of truth,
shared with the library); the error reaches the client as a 400 before the request reaches the engine.
Responses are built as plain dicts in the serving modules: the hot streaming path stays cheap.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvserve.sampling_params import RequestOutputKind

# Deeper JSON than this is no request of ours (and would only cost the validators' recursion).
MAX_NESTING = 32
# OpenAI's roles. Any other role string would reach the chat template as is, and could open a turn of
# the template's own making ("<|im_start|>" + role).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def find_invalid_text(value, path: str = "", depth: int = 0) -> str | None:
    """The path of the first string (or object key) that is not valid Unicode, or that nests too deep."""
    if depth > MAX_NESTING:
        return path or "body"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and find_invalid_text(k, where, depth + 1):
                return (path or "body") + ".<key>"
            found = find_invalid_text(v, where, depth + 1)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = find_invalid_text(v, f"{path}[{i}]", depth + 1)
            if found:
                return found
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data):
        where = find_invalid_text(data)
        if where is not None:
            raise ValueError(f"{where}: text must be valid UTF-8 (no lone surrogates) and nest at most "
                             f"{MAX_NESTING} levels.")
        return data


class StreamOptions(_Request):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions, named as SamplingParams names them."""

    model_config = ConfigDict(extra="allow")  # kept so request_fields.check_fields can answer each one

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    request_id: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs object and its older guided_* fields
    # (entrypoints/openai/structured_request.py reads them into one constraint).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    truncate_prompt_tokens: int | None = None  # keep only the last N prompt tokens (-1: max_model_len)

    def sampling_fields(self, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
        """Keyword arguments for SamplingParams. None means "the default" (OpenAI clients send nulls)."""
        fields: dict[str, Any] = {
            "n": self.n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "bad_words": self.bad_words,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "logit_bias": self.logit_bias,
            "allowed_token_ids": self.allowed_token_ids,
            # Both paths read deltas: the stream forwards them, the non-streaming path joins them.
            "output_kind": RequestOutputKind.DELTA,
        }
        return {k: v for k, v in fields.items() if v is not None}

    def check_common(self) -> None:
        """Checks SamplingParams cannot make (they concern the API, not sampling)."""
        if self.use_beam_search:
            raise ValueError("use_beam_search is not supported.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported.")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true.")
        if self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern is not supported; use structured_outputs with "
                             "disable_any_whitespace.")
        if self.stream and self.prompt_logprobs is not None and self.prompt_logprobs != 0:
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM); "
                             "send the request without stream.")
        if self.truncate_prompt_tokens is not None and not (
                self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1):
            raise ValueError(f"truncate_prompt_tokens must be at least 1, or -1 (the model's context length), "
                             f"got {self.truncate_prompt_tokens}.")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @property
    def num_prompts(self) -> int:
        p = self.prompt
        return 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise ValueError("suffix is not supported.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be a non-negative integer, got {self.logprobs}.")


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the chat template as given

    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(sorted(CHAT_ROLES))}, got {role[:40]!r}.")
        return role


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM: the reply starts with the last message's content when it has the reply's role

    def check(self) -> None:
        self.check_common()
        # As vLLM: -1 asks for the whole vocabulary (SamplingParams then needs --max-logprobs -1); a count
        # that returns alternatives needs logprobs: true. (Completions' `logprobs` has no -1, as in vLLM.)
        if self.top_logprobs is not None:
            if self.top_logprobs < -1:
                raise ValueError(f"top_logprobs must be a non-negative integer or -1, got {self.top_logprobs}.")
            if self.top_logprobs != 0 and not self.logprobs:
                raise ValueError("top_logprobs needs logprobs set to true.")
        # The tools themselves and tool_choice's other forms: structured_request.tool_plan.
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError(f"tool_choice {str(self.tool_choice)[:60]} needs tools: send the tools the "
                             f"model may call, or leave tool_choice unset.")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")

    @property
    def num_prompts(self) -> int:
        return 1

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]

