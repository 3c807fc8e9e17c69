"""Continuous batching: each step fills a token budget with running requests, then waiting ones.

There is no separate prefill phase: a request has `num_tokens` known tokens and
`num_computed_tokens` with K/V in the cache, and each step schedules some of the difference
(a prefill chunk, a whole prompt, or the one newest token of a decode).

Computed counts advance when a step is scheduled, not when it returns, so the next step can be
scheduled while this one still runs (async scheduling). A token sampled by a step in flight is
"pending": the next step may already compute it, with PLACEHOLDER_TOKEN_ID standing for the id the
model runner reads on the device; `update` then fills in the real id.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.core.kv_cache_manager import KVCacheManager, cdiv
from kvserve.core.request import Request, RequestStatus
from kvserve.core.request_queue import RequestQueue

_WAIT = object()  # admission of this request must wait for another one to progress
PLACEHOLDER_TOKEN_ID = -1  # a token sampled by the step in flight: its id is still on the device


PREEMPTION_MODES = ("recompute", "swap", "auto")


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # Pipeline parallelism keeps several batches in flight, and a request may be in only one of them
    # (its next chunk needs the K/V and the token of the last): running requests in a batch still in
    # flight are skipped, so no placeholder is ever scheduled. False: async scheduling's placeholders.
    exclusive_batches: bool = False
    # recompute: drop a victim's K/V and prefill it again; swap: copy its blocks to CPU and back (falls
    # back to recompute when the swap space is full); auto: whichever costs less for this victim.
    preemption_mode: str = "recompute"
    # Costs that `auto` compares (measured at start-up): recomputing one token; copying one block out and in.
    recompute_seconds_per_token: float = 0.0
    swap_seconds_per_block: float = 0.0


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
    """What the model runner needs for one request in one step."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step (the last may be PLACEHOLDER_TOKEN_ID)
    start_pos: int  # position of token_ids[0] == tokens already in the cache
    new_block_ids: list[int]  # appended to the request's block table
    is_new: bool  # first step since admission/resumption: the runner starts a fresh block table
    needs_sample: bool  # this step reaches the end of the known tokens
    sampling_params: object
    output_len: int  # output tokens so far (seeded sampling, min_tokens)
    # The request's own lists, by reference (no copy): penalties, bad words and prompt logprobs read them.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # The scheduler's own object: its result is dropped if the request ended (or its id was reused) meanwhile.
    request: Request | None = field(default=None, repr=False)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    # Finished since the last step, so the runner can drop per-request state.
    finished_req_ids: list[str] = field(default_factory=list)
    # Block copies the runner does before the step's forward, swap-outs first: (gpu_block, cpu_block).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preemptions: list[PreemptionEvent] = field(default_factory=list)
    # Structured outputs: the int32 [rows, ceil(vocab / 32)] token bitmask of the constrained requests that
    # sample this step, and request id -> its row; filled by the engine after scheduling (None: no row).
    grammar_bitmask: object = None
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, structured_output=None):
        """structured_output: the StructuredOutputManager that owns the constrained requests' matchers
        (duck-typed, so this package stays free of torch and of grammar libraries), or None."""
        self.config = config
        self.kv = kv_cache_manager
        self.structured_output = structured_output
        self._grammar_failed: list[Request] = []  # finished in schedule(), reported by the next update()
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0
        # request id -> scheduled batches not yet passed to update() that hold it
        self.in_flight: dict[str, int] = {}
        self.num_preemptions_by_mode = {"recompute": 0, "swap": 0}
        if config.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode {config.preemption_mode!r} is not one of {', '.join(PREEMPTION_MODES)}")

    # ---- admission -------------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int) -> None:
        """Reject prompts that could never run instead of letting them wait forever."""
        cfg = self.config
        if num_prompt_tokens > cfg.max_model_len:
            raise ValueError(
                f"The prompt (length {num_prompt_tokens}) is longer than the maximum model length "
                f"of {cfg.max_model_len} (max_model_len). Shorten the prompt or raise --max-model-len."
            )
        if not cfg.enable_chunked_prefill and num_prompt_tokens > cfg.max_num_batched_tokens:
            raise ValueError(
                f"The prompt (length {num_prompt_tokens}) exceeds max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}) and chunked prefill is off. Enable chunked prefill or "
                f"raise --max-num-batched-tokens."
            )
        total_tokens = self.kv.num_blocks * self.kv.block_size
        if num_prompt_tokens > total_tokens:
            raise ValueError(
                f"The prompt (length {num_prompt_tokens}) can never fit in the KV cache "
                f"({total_tokens} tokens in all). Give the KV cache more memory or shorten the prompt."
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens)
        request.max_model_len = self.config.max_model_len
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = self.config.max_num_batched_tokens

        # Running requests first (decodes and unfinished prefill chunks), in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.certain_to_finish():  # its length cap is reached by tokens in flight: nothing to compute
                i += 1
                continue
            if self.config.exclusive_batches and req.request_id in self.in_flight:
                i += 1
                continue
            if req.num_pending_outputs and self._constrained(req):
                i += 1  # its next mask needs the token still in flight
                continue
            num_new = min(req.num_tokens + req.num_pending_outputs - req.num_computed_tokens, budget)
            new_block_ids = None
            while True:
                new_block_ids = self.kv.allocate_slots(req, num_new)
                if new_block_ids is not None:
                    break
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim, out)
                out.preempted_req_ids.append(victim.request_id)
                if victim is req:
                    break
            if new_block_ids is None:
                break
            out.scheduled.append(self._scheduled(req, num_new, new_block_ids, is_new=False))
            budget -= num_new
            i += 1

        # Then waiting requests, unless this step had to preempt (memory is short: let it drain).
        grammar_pending: list[Request] = []  # waiting for their grammar: skipped, not holding up the rest
        while (
            self.waiting
            and budget > 0
            and not out.preempted_req_ids
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting.peek()
            if req.num_pending_outputs:  # preempted while a step was in flight: resume once its token is known
                break
            if self._constrained(req) and not self._grammar_ready(req):
                if self.waiting and self.waiting.peek() is req:  # still compiling (a failed one is gone)
                    grammar_pending.append(self.waiting.popleft())
                continue
            if self.config.exclusive_batches and req.request_id in self.in_flight:
                break  # preempted while a chunk of it is in flight: resume once that batch is back
            if self.kv.is_swapped(req):
                num_new = self._swap_in(req, budget, out)
                if num_new is None:
                    break
                budget -= num_new
                continue
            shared = self._sibling_prefix(req) if req.prefix_source_id is not None else None
            if shared is _WAIT:
                break
            hit_blocks, num_hit_tokens = shared or self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            new_block_ids = self.kv.allocate_slots(req, num_new, hit_blocks)
            if new_block_ids is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, num_new, new_block_ids, is_new=True))
            budget -= num_new
        for req in grammar_pending:  # back in the queue, to be asked again next step
            self.waiting.append(req)

        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        in_flight = self.in_flight
        for sched in out.scheduled:
            in_flight[sched.request_id] = in_flight.get(sched.request_id, 0) + 1
        return out

    def _constrained(self, req: Request) -> bool:
        so = self.structured_output
        return so is not None and req.request_id in so

    def _grammar_ready(self, req: Request) -> bool:
        """Whether its grammar is compiled; a grammar that failed finishes the request (aborted)."""
        status = self.structured_output.status(req.request_id)
        if status == "failed":
            self.waiting.popleft()
            req.status = RequestStatus.FINISHED_ABORTED
            self._finish(req)
            self._grammar_failed.append(req)
        return status == "ready"

    def _sibling_prefix(self, req: Request):
        """n > 1: a sample takes its first sibling's full prompt blocks instead of computing its own.
        _WAIT while the sibling is still being scheduled through them (it runs first, so it gets there);
        None (use the prefix cache) if the sibling is not running."""
        src = self.requests.get(req.prefix_source_id)
        if src is None or src.status != RequestStatus.RUNNING:
            return None
        bs = self.kv.block_size
        num_blocks = min(req.num_tokens - 1, req.num_prompt_tokens) // bs
        if num_blocks == 0:
            return None
        # Tokens whose K/V the sibling has, or writes in this step (before any attention reads them).
        if src.num_computed_tokens < num_blocks * bs:
            return _WAIT
        return self.kv.shared_blocks(src.request_id, num_blocks), num_blocks * bs

    def _scheduled(self, req: Request, num_new: int, new_block_ids: list[int], is_new: bool) -> ScheduledRequest:
        """The step's view of `req`; its computed count (and pending count, if it samples) advance now."""
        start = req.num_computed_tokens
        end = start + num_new
        token_ids = req.token_ids_slice(start, min(end, req.num_tokens))
        if end > req.num_tokens:
            token_ids += [PLACEHOLDER_TOKEN_ID] * (end - req.num_tokens)
        needs_sample = end == req.num_tokens + req.num_pending_outputs
        sched = ScheduledRequest(
            request_id=req.request_id,
            token_ids=token_ids,
            start_pos=start,
            new_block_ids=new_block_ids,
            is_new=is_new,
            needs_sample=needs_sample,
            sampling_params=req.sampling_params,
            output_len=req.num_output_tokens + req.num_pending_outputs,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            request=req,
        )
        req.num_computed_tokens = end
        if needs_sample:
            req.num_pending_outputs += 1
        return sched

    def _swap_in(self, req: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Resumes a swapped-out request where it stopped; returns the tokens scheduled, or None to wait."""
        num_new = req.num_tokens - req.num_computed_tokens
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new = budget
        swapped = self.kv.swap_in(req, num_new)
        if swapped is None:
            return None
        pairs, block_ids = swapped
        self.waiting.popleft()
        out.blocks_to_swap_in.extend(pairs)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append(self._scheduled(req, num_new, block_ids, is_new=True))
        return num_new

    def _preemption_mode(self, req: Request) -> str:
        cfg = self.config
        if cfg.preemption_mode == "recompute" or not self.kv.can_swap_out(req):
            return "recompute"  # also when the swap space is full
        if cfg.preemption_mode == "swap":
            return "swap"
        recompute = req.num_computed_tokens * cfg.recompute_seconds_per_token
        swap = self.kv.num_blocks_held(req) * cfg.swap_seconds_per_block
        return "swap" if swap < recompute else "recompute"

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        mode = self._preemption_mode(req)
        num_blocks, num_tokens = self.kv.num_blocks_held(req), req.num_computed_tokens
        if mode == "swap":
            # Its K/V waits on the CPU; it resumes where it stopped.
            out.blocks_to_swap_out.extend(self.kv.swap_out(req))
        else:
            # Drop the K/V; prompt + outputs so far are prefilled again on resumption.
            self.kv.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_by_mode[mode] += 1
        self.waiting.appendleft(req)
        out.preemptions.append(PreemptionEvent(req.request_id, mode, num_tokens, num_blocks, self.kv.usage(),
                                               len(self.running), len(self.waiting)))

    def roll_back_running(self) -> None:
        """After a failed step: every running request recomputes from its prompt and the tokens it has (what
        the step had scheduled for it, and any token still in flight, is forgotten)."""
        # Always recompute, never swap: the failed forward may have left the K/V half written. Not a
        # preemption (no memory pressure), so no counter moves.
        for req in reversed(self.running):
            req.num_pending_outputs = 0
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(req)
        self.running.clear()
        for req in self.waiting:
            req.num_pending_outputs = 0

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append the step's sampled tokens and finish requests; returns those touched."""
        touched, self._grammar_failed = self._grammar_failed, []
        in_flight = self.in_flight
        so = self.structured_output
        for sched in out.scheduled:
            left = in_flight.pop(sched.request_id, 1) - 1
            if left:
                in_flight[sched.request_id] = left
            req = sched.request
            if req.is_finished or not sched.needs_sample:  # finished or aborted after scheduling
                continue
            req.num_pending_outputs -= 1
            token = sampled.get(sched.request_id)
            if token is None:  # it could never be scheduled again: fail loudly rather than spin
                raise KeyError(f"the step sampled no token for {sched.request_id!r}, which needed one")
            req.append_output_token(token)
            grammar_ended = so is not None and req.request_id in so and so.accept_token(req.request_id, token)
            if req.check_stop():
                self._finish(req)
            elif grammar_ended:  # the grammar's own end (e.g. its stop token under ignore_eos)
                req.status = RequestStatus.FINISHED_STOPPED
                self._finish(req)
            touched.append(req)
        return touched

    # ---- finishing -------------------------------------------------------------------------------
    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Abort, or finish for a reason found outside the core (a stop string). Linear in the number of
        ids: a waiting request leaves its queue in O(1), and the running list is filtered once."""
        leaving_running = set()
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            queued = req in self.waiting
            req.status = status
            if queued:
                self.waiting.remove(req)
            else:
                leaving_running.add(rid)
            self._release(req)
        if leaving_running:
            self.running = [r for r in self.running if r.request_id not in leaving_running]

    def _finish(self, req: Request) -> None:
        if req in self.waiting:  # preempted while its last step was in flight
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        self.kv.free(req)
        if self.structured_output is not None:
            self.structured_output.free(req.request_id)
        del self.requests[req.request_id]
        self._finished_since_last_step.append(req.request_id)

    def max_blocks_per_request(self) -> int:
        return cdiv(self.config.max_model_len, self.kv.block_size)
