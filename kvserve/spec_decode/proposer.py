"""The proposer interface: before a step that drafts, the engine asks for draft tokens per running request.

A proposer sees each request read-only (`RequestView`: its id, prompt, outputs so far and sampling
parameters) and returns, for the requests it has a guess for, the tokens it expects next. The scheduler
offers them to the next step, capped by the token budget and the request's length limits; the runner
verifies them, and only what the target model would have produced is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class RequestView(Protocol):
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: Any


class Proposer(Protocol):
    def propose(self, requests: Sequence[RequestView]) -> dict[str, list[int]]:
        """Draft tokens per request id (requests left out get none). Must not modify the requests."""
        ...
