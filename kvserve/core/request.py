"""A request's scheduling state: its tokens, how many have K/V computed, and its lifecycle."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(eq=False)  # identity equality: requests are looked up in queues
class Request:
    """One sequence as the scheduler sees it.

    `sampling_params` is opaque to the core except for the few fields read by `stop_status`
    (max_tokens, min_tokens, ignore_eos, stop_token_ids), so the core stays free of torch.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    max_model_len: int | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose K/V are in the cache, or are being written by a step in flight (prefix hits count).
    num_computed_tokens: int = 0
    # Async scheduling: tokens sampled by a step still in flight, whose ids the host does not know yet.
    # The next step can already compute them: the model runner reads their ids on the device.
    num_pending_outputs: int = 0
    # Speculative decoding: drafts offered for the next step, and how many the step in flight verifies
    # (its token count is unknown until update, so the request is not scheduled again before then).
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_in_flight: int = 0
    # Drafts this request had verified, and how many of them were accepted (RequestOutput.metrics).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Output tokens the workers have been sent (step messages carry only the ones after these).
    num_output_tokens_sent: int = 0
    # Chained hashes of this request's full blocks, extended as tokens arrive.
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit length at first admission
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    # n > 1: the sibling sample whose prompt blocks this one shares (by reference count, not by copy).
    prefix_source_id: str | None = None
    # The API request this sequence belongs to (its prompts x n samples): admission takes turns across
    # groups (request_queue.py). None: a group of its own.
    group_id: str | None = None

    @property
    def fairness_group(self) -> str:
        return self.group_id if self.group_id is not None else self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def __post_init__(self):
        # Read several times per request per step: kept as a plain int rather than recomputed.
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def certain_to_finish(self) -> bool:
        """Whether the pending tokens reach max_tokens or max_model_len: no need to schedule another step."""
        return self.num_pending_outputs > 0 and self._length_capped(self.num_pending_outputs)

    def _length_capped(self, extra_tokens: int = 0) -> bool:
        """Whether max_tokens or max_model_len is reached, counting `extra_tokens` not yet appended."""
        max_tokens = getattr(self.sampling_params, "max_tokens", None)
        if max_tokens is not None and len(self.output_token_ids) + extra_tokens >= max_tokens:
            return True
        return self.max_model_len is not None and self.num_tokens + extra_tokens >= self.max_model_len

    def max_num_drafts(self) -> int:
        """Drafts a step may verify: all of them accepted plus one more token must stay within the caps."""
        room = self.max_model_len - self.num_tokens - 1 if self.max_model_len is not None else 1 << 30
        max_tokens = getattr(self.sampling_params, "max_tokens", None)
        if max_tokens is not None:
            room = min(room, max_tokens - len(self.output_token_ids) - 1)
        return max(0, room)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) across prompt and output without building the full list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.num_tokens += 1

    def stop_status(self) -> tuple[RequestStatus, int | None] | None:
        """(finished status, stop token id) when the newest token ends the request, else None. Only read
        here: the scheduler's update sets it."""
        params = self.sampling_params
        n_out = len(self.output_token_ids)
        if n_out == 0:
            return None
        last = self.output_token_ids[-1]
        min_tokens = getattr(params, "min_tokens", 0) or 0
        if n_out >= min_tokens:
            if (not getattr(params, "ignore_eos", False)) and last == self.eos_token_id:
                return RequestStatus.FINISHED_STOPPED, None
            stop_ids = getattr(params, "stop_token_ids", None) or ()
            if last in stop_ids:
                return RequestStatus.FINISHED_STOPPED, last
        if self._length_capped():
            return RequestStatus.FINISHED_LENGTH_CAPPED, None
        return None
