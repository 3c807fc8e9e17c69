"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    detokenize: bool = True
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, msg: str):
            raise ValueError(f"{name} {msg}")

        if self.n < 1:
            bad("n", f"must be at least 1, got {self.n}.")
        if self.n != 1:
            bad("n", "> 1 is not supported yet; send n separate requests.")
        if self.temperature < 0:
            bad("temperature", f"must be non-negative, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (off) or a positive integer, got {self.top_k}.")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
