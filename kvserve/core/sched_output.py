"""What one scheduled step is: the scheduler's own record of it, and the one message every executor sends.

`SchedulerOutput` is the driver's record: which Request objects the step computes and how (the engine's
update and output processing read it; it never leaves the engine's process). `StepMessage` is what the
workers get, built once per step by the scheduler and handed as it is to the in-process runner (uni) or
pickled to worker processes and actors (mp, ray), so a test of the message is a test of every executor.
It holds no reference to the scheduler's lists: what it carries is copied (slices), so a worker can keep
it.

The message is a diff: a request's prompt and sampling parameters travel in the first step that
schedules it after admission or resumption (NewRequestData); every later step carries only its new
block ids, where its chunk starts and the output ids sampled since the workers last heard of it
(CachedRequestData: one per decode step, none while the step that samples it is still in flight).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PLACEHOLDER_TOKEN_ID = -1  # a token sampled by the step in flight: its id is still on the device
# The tokens of a decode scheduled behind the step in flight (most steps under async scheduling, once per
# request): one shared list, read and never changed, so such a step allocates none.
ONE_PLACEHOLDER: list[int] = [PLACEHOLDER_TOKEN_ID]


@dataclass
class PreemptionEvent:
    """One preemption, as the engine logs it."""

    request_id: str
    mode: str  # "recompute" | "swap"
    num_tokens: int  # K/V tokens dropped (to recompute) or kept on CPU (swapped)
    num_blocks: int  # GPU blocks freed
    kv_usage: float  # GPU KV usage after the preemption
    num_running: int
    num_waiting: int


@dataclass
class ScheduledRequest:
    """The scheduler's record of one request in one step (driver side only)."""

    request_id: str
    # The tokens computed this step: known ids, then PLACEHOLDER_TOKEN_ID for a token the step in flight
    # samples, then the draft tokens offered for verification (spec_token_ids).
    token_ids: list[int]
    start_pos: int  # position of token_ids[0] == tokens already in the cache
    # Appended to the request's block tables, one list per KV cache group (its whole tables when is_new).
    new_block_ids: tuple[list[int], ...]
    is_new: bool  # first step since admission/resumption: the runner starts a fresh block table
    needs_sample: bool  # this step reaches the end of the known tokens
    output_len: int  # output tokens so far, counting those in flight
    # The scheduler's own object: its result is dropped if the request ended (or its id was reused) meanwhile.
    request: Any = field(default=None, repr=False)
    spec_token_ids: Sequence[int] = ()  # draft tokens at the end of token_ids


@dataclass
class NewRequestData:
    """A request the workers do not hold yet (admitted, or resumed after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    output_token_ids: list[int]  # outputs known so far (a resumed request has some)
    block_ids: tuple[list[int], ...]  # its whole block tables, one per KV cache group
    num_computed_tokens: int  # where this step's chunk starts
    adapter_id: int | None = None  # slot for LoRA: the adapter the request runs with (none yet)


@dataclass
class CachedRequestData:
    """Requests the workers already hold, as parallel lists (one object per step pickles small)."""

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # output ids sampled since the last message
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)  # appended to each group's table
    num_computed_tokens: list[int] = field(default_factory=list)  # where this step's chunk starts


@dataclass
class StepMessage:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # Batch order: request id -> tokens computed this step (known ids, a placeholder, then its drafts).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Draft tokens to verify, per request (at the end of its scheduled tokens).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Slots for structured outputs: request id -> row of `grammar_bitmask` (packed allowed-token masks).
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None
    # Async scheduling: the mask (and its rows) arrives after this message, once the step before is updated
    # (Executor.send_grammar_bitmask); the workers run the forward meanwhile and apply it just before sampling.
    grammar_bitmask_deferred: bool = False
    finished_req_ids: list[str] = field(default_factory=list)  # the workers drop their state
    preempted_req_ids: list[str] = field(default_factory=list)  # the workers drop their block tables
    # Block tables cut back to this many blocks since the last step (rejected drafts' blocks were
    # freed), applied before this step's new block ids.
    trimmed_block_tables: dict[str, int] = field(default_factory=dict)
    # Block copies done before the step's forward, swap-outs first: (gpu_block, cpu_block).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    # Finished since the last step, so the runner can drop per-request state.
    finished_req_ids: list[str] = field(default_factory=list)
    # Request id -> blocks its table kept when rejected drafts were rolled back since the last step.
    trimmed_block_tables: dict[str, int] = field(default_factory=dict)
    # Block copies the runner does before the step's forward, swap-outs first: (gpu_block, cpu_block).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preemptions: list[PreemptionEvent] = field(default_factory=list)
    message: StepMessage = field(default_factory=StepMessage)  # what the workers get

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def build_step_message(out: SchedulerOutput) -> StepMessage:
    """The workers' message for a scheduled step; advances each request's count of outputs sent."""
    msg = StepMessage(
        total_num_scheduled_tokens=out.total_num_scheduled_tokens, finished_req_ids=out.finished_req_ids,
        preempted_req_ids=out.preempted_req_ids, trimmed_block_tables=out.trimmed_block_tables,
        blocks_to_swap_out=out.blocks_to_swap_out,
        blocks_to_swap_in=out.blocks_to_swap_in,
    )
    cached = msg.scheduled_cached_reqs
    num_scheduled = msg.num_scheduled_tokens
    # Once per scheduled request per step: the lists' append methods are looked up once.
    add_id, add_tokens = cached.req_ids.append, cached.new_token_ids.append
    add_blocks, add_start = cached.new_block_ids.append, cached.num_computed_tokens.append
    for s in out.scheduled:
        req = s.request
        rid = s.request_id
        outputs = req.output_token_ids
        n = len(outputs)
        if s.is_new:
            msg.scheduled_new_reqs.append(NewRequestData(
                rid, req.prompt_token_ids, req.sampling_params, outputs[:], s.new_block_ids, s.start_pos))
        else:
            sent = req.num_output_tokens_sent
            add_id(rid)
            add_tokens(outputs[sent:] if n > sent else [])
            add_blocks(s.new_block_ids)
            add_start(s.start_pos)
        req.num_output_tokens_sent = n
        num_scheduled[rid] = len(s.token_ids)
        if s.spec_token_ids:
            msg.scheduled_spec_decode_tokens[rid] = s.spec_token_ids
    return msg
