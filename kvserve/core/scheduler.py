"""Continuous batching: each step fills a token budget with running requests, then waiting ones.

There is no separate prefill phase: a request has `num_tokens` known tokens and
`num_computed_tokens` with K/V in the cache, and each step schedules some of the difference
(a prefill chunk, a whole prompt, or the one newest token of a decode).

Computed counts advance when a step is scheduled, not when it returns, so the next step can be
scheduled while this one still runs (async scheduling). A token sampled by a step in flight is
"pending": the next step may already compute it, with PLACEHOLDER_TOKEN_ID standing for the id the
model runner reads on the device; `update` then fills in the real id.

Speculative decoding: a decoding request may carry draft tokens (`update_draft_token_ids`). A step then
computes them after its last known token (their slots are lookahead: allocated, never cached) and
samples at each; `update` receives the accepted drafts plus one token, appends them one by one while
checking stops (a stop in the middle drops the rest), and rolls back the rejected ones: the computed
count goes back and blocks past it are freed. `update` is the only writer of a request's status.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.core.kv_cache_manager import GroupBlockIds, KVCacheManager, cdiv
from kvserve.core.request import Request, RequestStatus
from kvserve.core.request_queue import RequestQueue
from kvserve.request_limits import check_prompt_length
from kvserve.core.sched_output import (  # the step's types, also imported from here by the scheduler's users
    ONE_PLACEHOLDER,
    PLACEHOLDER_TOKEN_ID,
    PreemptionEvent,
    ScheduledRequest,
    SchedulerOutput,
    build_step_message,
)

_WAIT = object()
_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED  # statuses from here on are finished  # admission of this request must wait for another one to progress


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
    # The engine fills a step's grammar bitmask once the step before it is updated (the workers apply it just
    # before sampling), so a constrained request may be scheduled while its last token is in flight.
    # False: such a request waits for that token.
    grammar_bitmask_after_update: bool = False


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
        self._trimmed_since_last_step: dict[str, int] = {}  # request id -> blocks kept after a rollback
        self.num_preemptions = 0
        # request id -> scheduled batches not yet passed to update() that hold it
        self.in_flight: dict[str, int] = {}
        self.num_preemptions_by_mode = {"recompute": 0, "swap": 0}
        # Speculative decoding: draft tokens verified, and of those, accepted (appended as outputs).
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        if config.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode {config.preemption_mode!r} is not one of {', '.join(PREEMPTION_MODES)}")

    # ---- admission -------------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int) -> None:
        """Reject prompts that could never run instead of letting them wait forever: longer than the context
        (the request validator's check), the step budget without chunking, or the KV cache."""
        cfg = self.config
        check_prompt_length(num_prompt_tokens, cfg.max_model_len)
        if not cfg.enable_chunked_prefill and num_prompt_tokens > cfg.max_num_batched_tokens:
            raise ValueError(
                f"The prompt (length {num_prompt_tokens}) exceeds max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}) and chunked prefill is off. Enable chunked prefill or "
                f"raise --max-num-batched-tokens."
            )
        first_chunk = min(num_prompt_tokens, cfg.max_num_batched_tokens) if cfg.enable_chunked_prefill else num_prompt_tokens
        needed = self.kv.blocks_needed(num_prompt_tokens, first_chunk)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"The prompt (length {num_prompt_tokens}) can never fit in the KV cache: it needs {needed} "
                f"blocks of {self.kv.block_size} tokens and the cache has {self.kv.num_blocks}. Give the KV "
                f"cache more memory or shorten the prompt."
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
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step,
                              trimmed_block_tables=self._trimmed_since_last_step)
        self._finished_since_last_step = []
        if self._trimmed_since_last_step:
            self._trimmed_since_last_step = {}
        budget = self.config.max_num_batched_tokens

        # Running requests first (decodes and unfinished prefill chunks), in admission order. This loop
        # runs once per running request per step: what it reads often is held in locals.
        running, scheduled = self.running, out.scheduled
        so = self.structured_output
        mask_waits_for_update = so is not None and not self.config.grammar_bitmask_after_update
        in_flight = self.in_flight if self.config.exclusive_batches else None
        allocate_slots = self.kv.allocate_slots
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            i += 1
            pending = req.num_pending_outputs
            if pending and req.certain_to_finish():  # the cap is reached by tokens in flight: nothing to compute
                continue
            if req.num_spec_in_flight or (in_flight is not None and req.request_id in in_flight):
                continue
            if pending and mask_waits_for_update and req.request_id in so:
                continue  # its next mask needs the token still in flight
            num_new = min(req.num_tokens + pending - req.num_computed_tokens, budget)
            num_drafts = 0
            if req.spec_token_ids and not pending and num_new == req.num_tokens - req.num_computed_tokens:
                num_drafts = min(len(req.spec_token_ids), budget - num_new, req.max_num_drafts())
            while True:
                new_block_ids = allocate_slots(req, num_new, None, num_drafts)
                if new_block_ids is not None:
                    break
                victim = running.pop()  # the most recently admitted
                self._preempt(victim, out)
                out.preempted_req_ids.append(victim.request_id)
                if victim is req:
                    break
            if new_block_ids is None:
                break
            if req.spec_token_ids:
                scheduled.append(self._scheduled(req, num_new, new_block_ids, False, req.spec_token_ids[:num_drafts]))
                req.spec_token_ids = []  # offered once: the proposer offers fresh ones for the next drafting step
            else:
                scheduled.append(self._scheduled(req, num_new, new_block_ids, False))
            budget -= num_new + num_drafts

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
        out.message = build_step_message(out)
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
        blocks = self.kv.shared_blocks(src.request_id, num_blocks)
        return None if blocks is None else (blocks, num_blocks * bs)

    def _scheduled(self, req: Request, num_new: int, new_block_ids: GroupBlockIds, is_new: bool,
                   drafts: list[int] = ()) -> ScheduledRequest:
        """The step's view of `req`; its computed count (and pending count, if it samples) advance now.
        `drafts` are computed after the known tokens (only a chunk that reaches them has any)."""
        start = req.num_computed_tokens
        end = start + num_new
        num_tokens = req.num_tokens
        if start >= num_tokens and not drafts:  # a decode behind a step in flight: only placeholders
            token_ids = ONE_PLACEHOLDER if end - num_tokens == 1 else [PLACEHOLDER_TOKEN_ID] * (end - num_tokens)
        else:
            token_ids = req.token_ids_slice(start, min(end, num_tokens))
            if end > num_tokens:
                token_ids += [PLACEHOLDER_TOKEN_ID] * (end - num_tokens)
        pending = req.num_pending_outputs
        needs_sample = end == num_tokens + pending
        sched = ScheduledRequest(req.request_id, token_ids, start, new_block_ids, is_new, needs_sample,
                                 len(req.output_token_ids) + pending, req)
        if drafts:
            token_ids.extend(drafts)
            sched.spec_token_ids = drafts
            req.num_spec_in_flight = len(drafts)
            end += len(drafts)
        req.num_computed_tokens = end
        if needs_sample:
            req.num_pending_outputs = pending + 1
        return sched

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        """Draft tokens a proposer offers for each request's next step (unknown or finished ids are ignored)."""
        for rid, tokens in drafts.items():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.spec_token_ids = list(tokens)

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
            req.num_spec_in_flight = 0
            req.spec_token_ids = []
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(req)
        self.running.clear()
        for req in self.waiting:
            req.num_pending_outputs = 0
            req.num_spec_in_flight = 0

    def update(self, out: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> list[Request]:
        """Append each request's new tokens (one, or its accepted drafts and one more), checking stops on
        every one; roll back rejected drafts; finish requests. Returns the requests touched."""
        touched, self._grammar_failed = self._grammar_failed, []
        in_flight = self.in_flight
        so = self.structured_output
        for sched in out.scheduled:
            rid = sched.request_id
            left = in_flight.pop(rid, 1) - 1
            if left:
                in_flight[rid] = left
            req = sched.request
            num_drafts = len(sched.spec_token_ids)
            if num_drafts:
                req.num_spec_in_flight = 0
            if req.status >= _FIRST_FINISHED or not sched.needs_sample:  # finished or aborted after scheduling
                continue
            req.num_pending_outputs -= 1
            tokens = sampled_token_ids.get(rid)
            if not tokens or len(tokens) > num_drafts + 1:  # it could never be scheduled again: fail loudly
                raise KeyError(f"the step sampled {tokens!r} for {rid!r}, which needed 1 to "
                               f"{num_drafts + 1} tokens")
            constrained = so is not None and rid in so
            stop = None
            num_appended = 0
            for token in tokens:
                req.append_output_token(token)
                num_appended += 1
                grammar_ended = constrained and so.accept_token(rid, token)
                stop = req.stop_status()
                if stop is None and grammar_ended:  # the grammar's own end (e.g. its stop token under ignore_eos)
                    stop = (RequestStatus.FINISHED_STOPPED, None)
                if stop is not None:
                    break
            if num_drafts:
                self.num_draft_tokens += num_drafts
                self.num_accepted_tokens += num_appended - 1
                req.num_draft_tokens += num_drafts
                req.num_accepted_tokens += num_appended - 1
            if stop is not None:
                req.status, reason = stop
                if reason is not None:
                    req.stop_reason = reason
                self._finish(req)
            elif num_drafts:
                self._roll_back_rejected(req, num_drafts + 1 - num_appended)
            touched.append(req)
        return touched

    def _roll_back_rejected(self, req: Request, num_rejected: int) -> None:
        """Forget the K/V of rejected drafts: the computed count goes back, blocks past it are freed."""
        if not num_rejected or not req.num_computed_tokens:  # all accepted, or preempted by recompute meanwhile
            return
        req.num_computed_tokens -= num_rejected
        if req.status == RequestStatus.RUNNING:
            kept = self.kv.trim(req)
            if kept is not None:  # the workers cut their copy of the table with the next message
                self._trimmed_since_last_step[req.request_id] = kept

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

    def finish_by_stop_strings(self, stops: Iterable[tuple[Request, int, str]]) -> None:
        """(request, output tokens to keep, stop string) found by the detokenizer: the request ends there,
        stopped (also when its last token ended it otherwise: the stop string wins, as in vLLM). Tokens
        after the one that completed the string (accepted drafts) are dropped."""
        for req, num_kept, stop in stops:
            del req.output_token_ids[num_kept:]
            req.num_tokens = req.num_prompt_tokens + len(req.output_token_ids)
            req.stop_reason = stop
            was_finished = req.is_finished
            req.status = RequestStatus.FINISHED_STOPPED
            if not was_finished:
                self._finish(req)

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
