"""How much work one API request may bring, and how much may wait: the server's admission limits.

A request's fan-out (prompts x n sequences) is refused with a 400 before any prompt is tokenized; work that
would overflow the waiting queue (sequences beyond what the engine runs at once) is refused with a 429 and
Retry-After, so a burst costs its senders a retry instead of costing every user minutes of queueing. The
queue bound itself is kept by AsyncEngine, which knows what is live.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 2048  # prompts x n
DEFAULT_MAX_WAITING_REQUESTS = 4096  # sequences queued beyond --max-num-seqs
MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True)
class AdmissionLimits:
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS

    def __post_init__(self):
        for name in ("max_prompts_per_request", "max_sequences_per_request", "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")

    def check_fan_out(self, num_prompts: int, n: int, max_n: int) -> None:
        """An n over --max-n is left to SamplingParams, which owns that limit and says so."""
        from kvserve.entrypoints.openai.errors import APIError  # here: the CLI parser imports this module

        if num_prompts > self.max_prompts_per_request:
            raise APIError(f"prompt holds {num_prompts} prompts; at most {self.max_prompts_per_request} are allowed "
                           f"per request (--max-prompts-per-request). Split it into several requests.", 400, "prompt")
        if n <= max_n and num_prompts * n > self.max_sequences_per_request:
            raise APIError(f"n: {num_prompts} prompt(s) x n={n} is {num_prompts * n} sequences; at most "
                           f"{self.max_sequences_per_request} are allowed per request (--max-sequences-per-request). "
                           f"Lower n or split the prompts over several requests.", 400, "n")


def check_request_id(request_id: str | None) -> None:
    """A client-chosen id is echoed in every chunk and in the logs: short and printable only."""
    from kvserve.entrypoints.openai.errors import APIError

    if request_id is None:
        return
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise APIError(f"request_id may be at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}.",
                       400, "request_id")
    if not request_id.isprintable():
        raise APIError("request_id must be printable text (no newlines or control characters).", 400, "request_id")
