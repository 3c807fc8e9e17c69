"""SamplingParams: how one request's tokens are chosen, when it stops and what comes back (vLLM's fields)."""

from __future__ import annotations

import copy
import enum
import logging
from dataclasses import dataclass, field

from kvserve.request_limits import (  # noqa: F401 - the limits, also read from here by their users
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_N,
    MAX_LIST_LENGTHS,
    MAX_STOP_STRING_CHARS,
    MAX_TEMPERATURE,
    _real,
    _token_key,
    check_field_types,
    check_for_model,
    check_sampling_ranges,
    check_token_id_fields,
)
from kvserve.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
# Below this, softmax(logits / t) overflows to inf/nan in half precision; vLLM raises it to this.
_MIN_RANDOM_TEMPERATURE = 1e-2
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
        check_field_types(self)  # before normalising: a wrong type must not be coerced into a right one
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
        check_sampling_ranges(self)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
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

    def verify_for_model(self, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                         max_n: int = DEFAULT_MAX_N) -> None:
        """The limits that depend on the model and the operator's flags (request_limits.check_for_model)."""
        check_for_model(self, vocab_size, max_logprobs, max_n)

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
        check_token_id_fields(self, vocab_size)
