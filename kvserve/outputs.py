"""vLLM-shaped results: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution, and its rank there (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token first, then the top alternatives).
SampleLogprobs = list[dict[int, Logprob]]
# As above, with None for the first prompt token (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # None unless logprobs were requested
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding, over all samples of the request: drafts verified, and those accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # The request's one token count, kept by the engine's output processor: the API's usage, the Prometheus
    # counters and the dashboard (which reads those counters) all read these, so they agree.
    num_prompt_tokens: int = 0
    sample_generation_tokens: list[int] = field(default_factory=list)  # output tokens of each sample, by index
    finish_reason: str | None = None  # the request's, once finished: its first sample's ("stop", "length", ...)

    @property
    def num_generation_tokens(self) -> int:
        return sum(self.sample_generation_tokens)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = field(default=None, repr=False)
    num_preemptions: int = 0  # how often this request (all its samples) was preempted so far
