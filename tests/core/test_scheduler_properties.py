"""Property tests: a real Scheduler + KVCacheManager driven by random operation sequences.

A fake model runner keeps a simulated physical KV cache (block id -> slot -> token) so that
prefix-cache hits, evictions and block-table bookkeeping are checked against the token contents
each request would actually attend to, not only against the manager's own counters.

Both engine loops are driven. Sync: schedule(N), run, update(N). Async scheduling: schedule(N+1)
and run it while step N's sampled tokens are still "on the device", then update(N). In async mode a
scheduled chunk may end in PLACEHOLDER_TOKEN_ID, which the fake runner fills with the token it
sampled for that request in the previous step, as the real runner does on the device.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.core.block_pool import hash_block_tokens
from kvserve.core.kv_cache_manager import FREED, KVCacheManager, cdiv, first_block_in_window
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import PLACEHOLDER_TOKEN_ID, Scheduler, SchedulerConfig, SchedulerOutput

ALPHABET = 4  # tokens 0..3: prompts collide often, so prefix hits happen
EOS = 3


# n > 1 sibling sharing (Request.prefix_source_id), where this version of the core has it.
HAS_SIBLINGS = "prefix_source_id" in Request.__dataclass_fields__
HAS_SWAP = "preemption_mode" in SchedulerConfig.__dataclass_fields__


@dataclass
class Params:
    max_tokens: int
    ignore_eos: bool = True
    min_tokens: int = 0
    stop_token_ids: list = field(default_factory=list)


@dataclass(frozen=True)
class Cfg:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunked: bool
    caching: bool
    async_scheduling: bool = False
    # Swap preemption: CPU blocks, and for "auto" the costs it compares (recompute per token, swap per block).
    preemption_mode: str = "recompute"
    num_cpu_blocks: int = 0
    recompute_cost: float = 1.0
    swap_cost: float = 1.0
    # Pipeline parallelism: up to this many batches in flight, each request in at most one (0: off).
    pipeline_depth: int = 0
    # The KV cache groups' windows (None: full attention): a windowed group frees the blocks behind its
    # window; several groups are an interleaved local/global model (Gemma), each with its own tables.
    group_windows: tuple[int | None, ...] = (None,)

    @property
    def max_unapplied(self) -> int:
        """Steps in flight between operations: the engine collects the oldest once depth are launched."""
        if self.pipeline_depth:
            return self.pipeline_depth - 1
        return 1 if self.async_scheduling else 0


def content_token(rid: str, attended: list[int]) -> int:
    """A "model" whose next token is a function of what the request attends to: runs that compute the
    same sequences (sync or async, preempted or not) must sample the same tokens."""
    return zlib.crc32(bytes(attended)) % ALPHABET


class Harness:
    """Scheduler + KV manager + a fake runner, with every invariant checked after each operation.

    `token_fn(request_id, tokens attended to)` picks the sampled token; None draws it at random."""

    def __init__(self, cfg: Cfg, seed: int = 0, token_fn: Callable[[str, list[int]], int] | None = None):
        self.cfg = cfg
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size, enable_caching=cfg.caching,
                                 **({"num_cpu_blocks": cfg.num_cpu_blocks} if cfg.num_cpu_blocks else {}),
                                 **({"group_windows": cfg.group_windows} if cfg.group_windows != (None,) else {}))
        swap = dict(preemption_mode=cfg.preemption_mode, recompute_seconds_per_token=cfg.recompute_cost,
                    swap_seconds_per_block=cfg.swap_cost) if cfg.preemption_mode != "recompute" else {}
        self.sched = Scheduler(
            SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=cfg.max_model_len,
                enable_chunked_prefill=cfg.chunked,
                **swap,
                exclusive_batches=cfg.pipeline_depth > 0,
            ),
            self.kv,
        )
        self.rng = random.Random(seed)
        self.token_fn = token_fn
        self.all: dict[str, Request] = {}  # every accepted request, finished ones included
        self.rejected: list[str] = []
        self.physical: dict[int, list] = {}  # simulated KV: block id -> per-slot token (None = never written)
        self.cpu_physical: dict[int, list] = {}  # the same for CPU (swap) blocks
        self.num_swapped_out = self.num_swapped_in = 0
        self.runner_tables: dict[str, list[list[int]]] = {}  # the runner's view of each group's block table
        # Steps scheduled and run whose sampled tokens the scheduler has not seen yet (update pending),
        # oldest first: empty in sync mode between operations, at most one in async mode.
        self.unapplied: list[tuple[SchedulerOutput, dict[str, int]]] = []
        # The runner's copy of the previous step's samples, request id -> (position, token): what a
        # placeholder is filled from (the real runner keeps the previous sampled tensor on the device).
        self.last_sampled: dict[str, tuple[int, int]] = {}
        self.last_out: SchedulerOutput | None = None
        self.reported_finished: set[str] = set()
        self.num_steps = 0
        self.num_placeholders = 0  # tokens computed while their ids were still on the device
        self.budget_steps = 100
        self._next_id = 0
        self._hash_tokens: dict[bytes, list[int]] = {}  # block hash -> the tokens it was made from
        self._hashes_seen: dict[int, int] = {}  # id(request) -> its block hashes checked so far
        self.check()

    # ---- operations ------------------------------------------------------------------------------
    def add(
        self, prompt: list[int], max_tokens: int, ignore_eos: bool, use_eos: bool, prefix_source_id: str | None = None
    ) -> Request | None:
        rid = f"r{self._next_id}"
        self._next_id += 1
        r = Request(rid, list(prompt), Params(max_tokens, ignore_eos), eos_token_id=EOS if use_eos else None)
        if prefix_source_id is not None:
            r.prefix_source_id = prefix_source_id
        c = self.cfg
        must_reject = (
            len(prompt) > c.max_model_len
            or (not c.chunked and len(prompt) > c.max_num_batched_tokens)
            or self._blocks_for_prompt(len(prompt)) > c.num_blocks
        )
        if must_reject:
            with pytest.raises(ValueError):
                self.sched.add_request(r)
            assert rid not in self.sched.requests
            assert r not in self.sched.waiting and r not in self.sched.running
            self.rejected.append(rid)
            return None
        self.sched.add_request(r)
        assert r.status == RequestStatus.WAITING and self.sched.waiting[-1] is r
        self.all[rid] = r
        self.budget_steps += (len(prompt) + max_tokens) * 4
        return r

    def _blocks_for_prompt(self, n: int) -> int:
        """Blocks a prompt of n tokens holds at once in its first chunk: all of them in a full group; a
        window, a chunk and a partly filled block at each end in a windowed one."""
        c = self.cfg
        chunk = min(n, c.max_num_batched_tokens) if c.chunked else n
        full = cdiv(n, c.block_size)
        return sum(full if w is None else min(full, cdiv(w - 1 + chunk, c.block_size) + 1) for w in c.group_windows)

    def add_duplicate(self, rid: str) -> None:
        r = self.sched.requests[rid]
        before = (list(self.sched.waiting), list(self.sched.running))
        with pytest.raises(ValueError):
            self.sched.add_request(Request(rid, [0], Params(1)))
        assert self.sched.requests[rid] is r
        assert (list(self.sched.waiting), list(self.sched.running)) == before

    def step(self, finish_mid_step: str | None = None, status=RequestStatus.FINISHED_ABORTED) -> SchedulerOutput:
        """One engine iteration. `finish_mid_step` is aborted (or stopped by a stop string) after the
        batch ran but before results are applied: in async mode, before the previous step's update."""
        had_work = self.sched.has_unfinished_requests()
        was_running, was_waiting = list(self.sched.running), list(self.sched.waiting)
        before = {id(r): (r.num_computed_tokens, r.num_pending_outputs, r.num_tokens)
                  for r in was_running + was_waiting}
        out = self.sched.schedule()
        self.last_out = out
        self.num_steps += 1
        self._check_output(out, had_work, was_running, was_waiting, before)
        sampled = self._run_model(out)
        self.unapplied.append((out, sampled))
        if finish_mid_step is not None and finish_mid_step in self.sched.requests:
            self.sched.finish_requests([finish_mid_step], status)
        # Sync: apply this step. Async: apply the previous one and keep this one in flight (an empty
        # step is applied at once, as the engine does: there is nothing to overlap).
        if self.cfg.pipeline_depth:
            # As the engine: an empty step is applied at once, and then (or once depth batches are in
            # flight) the oldest batch is collected.
            if not out.scheduled:
                self.unapplied.insert(0, self.unapplied.pop())
                self._apply()
            if self.unapplied and (not out.scheduled or len(self.unapplied) >= self.cfg.pipeline_depth):
                self._apply()
            return out
        keep = 1 if self.cfg.async_scheduling and out.scheduled else 0
        while len(self.unapplied) > keep:
            self._apply()
        return out

    def flush(self) -> None:
        """Apply the step in flight without scheduling another (the engine idles, or needs history)."""
        assert self.unapplied
        self._apply()

    def abort(self, rid: str, status=RequestStatus.FINISHED_ABORTED) -> None:
        r = self.sched.requests[rid]
        self.sched.finish_requests([rid], status)
        assert r.status == status
        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)  # a second finish is a no-op
        assert r.status == status
        self.check()

    def drain(self) -> None:
        # Keep stepping while requests are unfinished or a step's results are still to be applied.
        while self.sched.has_unfinished_requests() or self.unapplied:
            assert self.num_steps <= self.budget_steps, (
                f"livelock: {self.num_steps} steps, waiting={[r.request_id for r in self.sched.waiting]}, "
                f"running={[r.request_id for r in self.sched.running]}"
            )
            if self.sched.has_unfinished_requests():
                self.step()
            else:
                self.flush()  # the last step's results (all dropped: their requests finished meanwhile)
        final = self.step()  # tells the runner about the last finishes
        assert final.is_empty and not self.unapplied
        self.check_all_done()

    def check_all_done(self) -> None:
        assert not self.unapplied
        assert self.kv.pool.num_free_blocks == self.cfg.num_blocks
        assert all(g.req_to_blocks == {} for g in self.kv.groups)
        assert _swap_space_free(self.kv)
        assert self.sched.requests == {}
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        for r in self.all.values():
            assert r.is_finished, r
            assert r.num_output_tokens <= self._max_outputs(r)
            assert r.num_tokens <= max(self.cfg.max_model_len, r.num_prompt_tokens + 1)

    # ---- the fake runner -------------------------------------------------------------------------
    def _truth(self, r: Request) -> list[int]:
        """r's tokens, followed by those sampled for it by steps not yet applied (ids the device has)."""
        toks = r.all_token_ids
        for out, sampled in self.unapplied:
            toks += [sampled[s.request_id] for s in out.scheduled if s.request is r and s.needs_sample]
        return toks

    def _in_flight(self, r: Request) -> bool:
        """r is in a scheduled batch whose results are not applied yet."""
        return any(s.request is r for out, _ in self.unapplied for s in out.scheduled)

    def _in_flight_samples(self, r: Request) -> int:
        return sum(1 for out, _ in self.unapplied for s in out.scheduled if s.request is r and s.needs_sample)

    def _run_model(self, out: SchedulerOutput) -> dict[str, int]:
        """Runs the step: K/V writes, placeholders filled, every read checked; returns the sampled tokens."""
        bs = self.cfg.block_size
        for rid in out.finished_req_ids + out.preempted_req_ids:
            self.runner_tables.pop(rid, None)
        # Swap copies before the forward, swap-outs first (a block swapped out may be swapped into).
        for gpu, cpu in getattr(out, "blocks_to_swap_out", ()):
            self.cpu_physical[cpu] = list(self.physical.get(gpu, [None] * bs))
            self.num_swapped_out += 1
        for gpu, cpu in getattr(out, "blocks_to_swap_in", ()):
            self.physical[gpu] = list(self.cpu_physical[cpu])
            self.num_swapped_in += 1
        windows = self.cfg.group_windows
        for s in out.scheduled:
            assert len(s.new_block_ids) == len(windows)
            if s.is_new:
                self.runner_tables[s.request_id] = [list(ids) for ids in s.new_block_ids]
            else:
                assert s.request_id in self.runner_tables, "continuing request unknown to the runner"
                for table, ids in zip(self.runner_tables[s.request_id], s.new_block_ids):
                    table += ids
            # Each group's incrementally built table matches the manager's, from the step's window on;
            # with a window, exactly the blocks before it are freed.
            for g, w in enumerate(windows):
                lo = first_block_in_window(s.start_pos, bs, w)
                table_now = self.kv.block_ids(s.request_id, g)
                assert len(self.runner_tables[s.request_id][g]) == len(table_now)
                assert self.runner_tables[s.request_id][g][lo:] == table_now[lo:]
                held = self.kv.groups[g].req_to_blocks[s.request_id]
                assert all(b is FREED for b in held[:lo]) and all(b is not FREED for b in held[lo:])
        # All K/V writes of the step (every group's layers), then all reads (attention), as in one forward pass.
        for s in out.scheduled:
            for k, tok in enumerate(s.token_ids):
                pos = s.start_pos + k
                if tok == PLACEHOLDER_TOKEN_ID:
                    # Filled from the previous step's sample for this request, at the position it sampled.
                    assert not s.is_new, "a new row has no previous sample on the device"
                    assert s.request_id in self.last_sampled, f"{s.request_id}: placeholder with no sample"
                    sample_pos, tok = self.last_sampled[s.request_id]
                    assert sample_pos == pos, (s.request_id, sample_pos, pos)
                    self.num_placeholders += 1
                for table in self.runner_tables[s.request_id]:
                    slots = self.physical.setdefault(table[pos // bs], [None] * bs)
                    slots[pos % bs] = tok
        sampled, self.last_sampled = {}, {}
        for s in out.scheduled:
            end = s.start_pos + len(s.token_ids)
            truth = self._truth(s.request)  # known tokens + those sampled by the step in flight
            attended = []  # the sampling query's keys, in every group's layers
            for table, w in zip(self.runner_tables[s.request_id], windows):
                # Every position some query of the step sees (with a window, from the first query's window on).
                first = 0 if w is None else max(0, s.start_pos - w + 1)
                seen = self._read(table, end, first)
                assert len(truth) >= end and seen == truth[first:end], f"{s.request_id} would attend to wrong K/V"
                attended += seen[max(0, end - w) - first:] if w is not None else seen
            if s.needs_sample:
                tok = self.token_fn(s.request_id, attended) if self.token_fn else self.rng.randrange(ALPHABET)
                sampled[s.request_id] = tok
                self.last_sampled[s.request_id] = (end, tok)
        return sampled

    def _read_cpu(self, table: list[int], n: int, first: int = 0) -> list:
        bs = self.cfg.block_size
        return [self.cpu_physical.get(table[p // bs], [None] * bs)[p % bs] for p in range(first, n)]

    def _read(self, table: list[int], n: int, first: int = 0) -> list:
        bs = self.cfg.block_size
        return [self.physical.get(table[p // bs], [None] * bs)[p % bs] for p in range(first, n)]

    def _apply(self) -> None:
        """scheduler.update() on the oldest unapplied step, checking exactly what it changes."""
        out, sampled = self.unapplied[0]
        snap = {id(r): (r.num_computed_tokens, r.num_pending_outputs, list(r.output_token_ids), r.status)
                for r in self.all.values()}
        touched = self.sched.update(out, {rid: [tok] for rid, tok in sampled.items()})
        self.unapplied.pop(0)
        # Results of requests that finished (or were aborted) since scheduling are dropped.
        expected = [s.request for s in out.scheduled if s.needs_sample and not snap[id(s.request)][3].is_finished]
        assert [id(r) for r in touched] == [id(r) for r in expected]
        applied = {id(r) for r in expected}
        for r in self.all.values():
            computed, pending, outputs, status = snap[id(r)]
            assert r.num_computed_tokens == computed  # counted at schedule time, never by update
            if id(r) not in applied:
                assert (r.num_pending_outputs, r.output_token_ids, r.status) == (pending, outputs, status)
                continue
            assert r.num_pending_outputs == pending - 1
            assert r.output_token_ids == outputs + [sampled[r.request_id]]
            if r.is_finished:
                self._check_finish_reason(r)
            else:
                assert r.status == status  # running stays running, preempted stays waiting
            if r.status == RequestStatus.RUNNING:
                # All but the newest token (known or in flight) is computed.
                assert r.num_computed_tokens == r.num_tokens + r.num_pending_outputs - 1
        self.check()

    # ---- checks ----------------------------------------------------------------------------------
    def _max_outputs(self, r: Request) -> int:
        """Outputs at which a request is length-capped: max_tokens, or max_model_len (at least one token)."""
        return min(r.sampling_params.max_tokens, max(1, self.cfg.max_model_len - r.num_prompt_tokens))

    def _certain_to_finish(self, r: Request, pending: int) -> bool:
        """Its tokens in flight reach a length cap: scheduling it again would compute a wasted token."""
        return pending > 0 and (r.num_output_tokens + pending >= r.sampling_params.max_tokens
                                or r.num_tokens + pending >= self.cfg.max_model_len)

    def _check_output(
        self, out: SchedulerOutput, had_work: bool, was_running: list[Request], was_waiting: list[Request],
        before: dict[int, tuple[int, int, int]],
    ) -> None:
        c = self.cfg
        # Every request finished since the previous step is reported to the runner exactly once.
        newly_finished = {rid for rid, r in self.all.items() if r.is_finished} - self.reported_finished
        assert len(out.finished_req_ids) == len(set(out.finished_req_ids))
        assert set(out.finished_req_ids) == newly_finished
        self.reported_finished |= newly_finished
        lens = [len(s.token_ids) for s in out.scheduled]
        assert all(n >= 1 for n in lens), lens
        assert sum(lens) == out.total_num_scheduled_tokens
        assert out.total_num_scheduled_tokens <= c.max_num_batched_tokens
        assert len(out.scheduled) <= c.max_num_seqs
        ids = [s.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids), "request scheduled twice in one step"
        # Progress: unfinished work means something is scheduled (no empty step, no deadlock), except
        # in async mode when every running request's length cap is already in flight: the pending
        # update finishes them (it must change something, or the next schedule is empty again).
        if had_work and not out.scheduled and c.pipeline_depth:
            # Every running request is in a batch in flight (or certain to finish); then the oldest is
            # collected, so this cannot repeat forever.
            assert self.unapplied, "unfinished requests, nothing in flight, nothing scheduled"
        elif had_work and not out.scheduled:
            assert c.async_scheduling, "unfinished requests but nothing scheduled"
            assert all(self._certain_to_finish(r, r.num_pending_outputs) for r in self.sched.running)
            live = list(self.sched.waiting) + self.sched.running
            assert any(r.num_pending_outputs for r in live), "nothing scheduled and nothing in flight: livelock"
        # Running requests come first, then admissions; no admissions in a step that preempted.
        flags = [s.is_new for s in out.scheduled]
        assert flags == sorted(flags)
        if out.preempted_req_ids:
            assert not any(flags)
        assert set(ids).isdisjoint(out.preempted_req_ids)
        # Preemption victims are the most recently admitted of the previously running requests.
        # They go back to the front of the queue, oldest first, so they resume before newer arrivals.
        if out.preempted_req_ids:
            n = len(out.preempted_req_ids)
            assert out.preempted_req_ids == [r.request_id for r in was_running[::-1][:n]]
            assert [r.request_id for r in self.sched.waiting] == out.preempted_req_ids[::-1] + [
                r.request_id for r in was_waiting
            ]
        # Admission is first come, first served: the admitted ones are a prefix of the waiting queue.
        admitted = [s.request_id for s in out.scheduled if s.is_new]
        assert admitted == [r.request_id for r in was_waiting[: len(admitted)]]
        # A running request is skipped only when the budget ran out or its length cap is in flight.
        scheduled_ids = {id(s.request) for s in out.scheduled}
        if sum(n for s, n in zip(out.scheduled, lens) if not s.is_new) < c.max_num_batched_tokens:
            for r in self.sched.running:
                if r in was_running and id(r) not in scheduled_ids:
                    assert self._certain_to_finish(r, before[id(r)][1]) or self._in_flight(r), \
                        f"{r.request_id} starved"
        # Requests not scheduled are untouched, but for preemption dropping the computed K/V.
        for r in was_running + was_waiting:
            if id(r) in scheduled_ids:
                continue
            computed, pending, _ = before[id(r)]
            if r.request_id in out.preempted_req_ids:
                assert r.status == RequestStatus.PREEMPTED
                # Swapped out: it keeps its computed count (the K/V waits on the CPU); else it recomputes.
                assert r.num_computed_tokens == (computed if _is_swapped(self.kv, r) else 0)
            else:
                assert r.num_computed_tokens == computed
            assert r.num_pending_outputs == pending
        swapped_in = {s.request_id for s in out.scheduled if s.is_new and before[id(s.request)][0] > 0}
        in_blocks = [g for g, _ in getattr(out, "blocks_to_swap_in", ())]
        assert len(set(in_blocks)) == len(in_blocks)
        assert set(in_blocks) <= {b for rid in swapped_in for table in self.kv.block_tables(rid) for b in table}
        if getattr(out, "blocks_to_swap_out", None):
            assert out.preempted_req_ids and not out.blocks_to_swap_in  # swap-outs only in a preempting step
        for s in out.scheduled:
            r = self.all[s.request_id]
            assert s.request is r
            assert r.status == RequestStatus.RUNNING
            computed, pending, num_tokens = before[id(r)]
            assert r.num_tokens == num_tokens
            # Only the step being applied next can be in flight (none in sync mode).
            assert pending <= (1 if c.async_scheduling else 0)
            if c.pipeline_depth:
                # Never in two batches in flight, so never a placeholder.
                assert not self._in_flight(r), f"{r.request_id} is in two batches in flight"
                assert PLACEHOLDER_TOKEN_ID not in s.token_ids
            end = s.start_pos + len(s.token_ids)
            if s.is_new and s.request_id in swapped_in:
                # Resumed from the swap space where it stopped, its K/V copied back.
                assert s.start_pos == computed > 0 and pending == 0
            elif s.is_new:
                # Admitted from the queue, where nothing is computed; a request preempted while a
                # step was in flight waits for that step's update before it is admitted again.
                assert computed == 0 and pending == 0
            else:
                assert s.start_pos == computed
            assert r.num_computed_tokens == end  # computed counts advance at schedule time
            # Known ids up to num_tokens, then a placeholder for each token sampled but not yet applied.
            known = max(s.start_pos, min(end, r.num_tokens))
            assert s.token_ids[: known - s.start_pos] == r.token_ids_slice(s.start_pos, known)
            assert s.token_ids[known - s.start_pos:] == [PLACEHOLDER_TOKEN_ID] * (end - known)
            assert end <= r.num_tokens + pending
            assert s.needs_sample == (end == r.num_tokens + pending)
            assert r.num_pending_outputs == pending + s.needs_sample
            assert s.output_len == r.num_output_tokens + pending  # outputs the sample at this step follows
            assert not self._certain_to_finish(r, pending), f"{r.request_id} scheduled past its length cap"
            assert end <= c.max_model_len
            assert len(self.kv.block_ids(s.request_id)) * c.block_size >= end
            # No more blocks than needed for what will be computed.
            assert len(self.kv.block_ids(s.request_id)) == cdiv(end, c.block_size)
            if not c.chunked:
                # Without chunked prefill a prompt (or a resumed request) is computed in one go.
                assert s.needs_sample
            if s.request_id in swapped_in:
                continue
            if s.is_new and not c.caching and getattr(r, "prefix_source_id", None) is None:
                assert s.start_pos == 0  # nothing to reuse without the prefix cache or a sibling
            if s.is_new and c.caching:
                assert s.start_pos % c.block_size == 0 and s.start_pos < r.num_tokens

    def _stops_on_eos(self, r: Request) -> bool:
        return not r.sampling_params.ignore_eos and r.eos_token_id is not None

    def _check_finish_reason(self, r: Request) -> None:
        p = r.sampling_params
        if r.status == RequestStatus.FINISHED_STOPPED:
            assert self._stops_on_eos(r) and r.output_token_ids[-1] == EOS
        elif r.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            # Exactly the cap: as many tokens as a sync run gives (an ignore_eos request always ends so).
            assert r.num_output_tokens == self._max_outputs(r)
            assert r.num_output_tokens == p.max_tokens or r.num_tokens >= self.cfg.max_model_len
        else:
            raise AssertionError(f"unexpected status {r.status!r}")

    def check(self) -> None:
        c, kv, sched = self.cfg, self.kv, self.sched
        kv.check_invariants()
        waiting, running = list(sched.waiting), list(sched.running)
        assert len(running) <= c.max_num_seqs
        assert {id(r) for r in waiting}.isdisjoint(id(r) for r in running)
        assert len({id(r) for r in waiting}) == len(waiting) and len({id(r) for r in running}) == len(running)
        live = {r.request_id for r in waiting} | {r.request_id for r in running}
        assert live == set(sched.requests)
        assert all(sched.requests[r.request_id] is r for r in waiting + running)
        # Every block is either free or held by some request table.
        held = {b.block_id for g in kv.groups for blocks in g.req_to_blocks.values() for b in blocks if b is not FREED}
        assert kv.pool.num_free_blocks + len(held) == c.num_blocks
        assert set(kv.pool._free).isdisjoint(held)
        # Only running requests hold blocks (waiting/preempted/finished ones hold none).
        assert all(set(g.req_to_blocks) <= {r.request_id for r in running} for g in kv.groups)
        assert len(self.unapplied) <= c.max_unapplied
        if c.pipeline_depth:  # each request in at most one batch in flight
            in_flight = [s.request_id for out, _ in self.unapplied for s in out.scheduled]
            assert len(in_flight) == len(set(in_flight))
        for r in waiting + running:
            # One pending output per step in flight that samples it: 0 or 1 between operations.
            assert r.num_pending_outputs == self._in_flight_samples(r) <= 1
            # Never sampled past a length cap, counting the tokens in flight.
            assert r.num_output_tokens + r.num_pending_outputs <= self._max_outputs(r)
            if self._stops_on_eos(r):
                assert EOS not in r.output_token_ids  # it would have stopped
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert all(r.request_id not in g.req_to_blocks for g in kv.groups)
            if _is_swapped(kv, r):
                # Swapped out: its computed K/V is on the CPU, one CPU block per live GPU block it had, group
                # after group (a windowed group's freed entries hold none).
                cpu_table = list(kv.swap_space.req_to_blocks[r.request_id])
                assert r.status == RequestStatus.PREEMPTED
                for num_freed, num_live in kv._swapped_layout[r.request_id]:
                    assert num_freed + num_live == cdiv(r.num_computed_tokens, c.block_size)
                    table, cpu_table = [None] * num_freed + cpu_table[:num_live], cpu_table[num_live:]
                    first = num_freed * c.block_size
                    assert (self._read_cpu(table, r.num_computed_tokens, first)
                            == self._truth(r)[first: r.num_computed_tokens])
                assert not cpu_table
            else:
                assert r.num_computed_tokens == 0
        for r in running:
            assert r.status == RequestStatus.RUNNING
            assert len(kv.block_ids(r.request_id)) * c.block_size >= r.num_computed_tokens and kv.block_ids(r.request_id)
            # Always something left to compute: at least the newest token (known or in flight).
            assert r.num_computed_tokens < r.num_tokens + r.num_pending_outputs
            if r.num_pending_outputs:
                assert r.num_computed_tokens == r.num_tokens + r.num_pending_outputs - 1
            assert r.num_computed_tokens <= c.max_model_len
            # The K/V this request has computed is really there, untouched by anyone else (tokens in
            # flight included: the runner filled them in from the device); with a window, the blocks
            # it still holds, in every group.
            for g, group in enumerate(kv.groups):
                blocks = group.req_to_blocks[r.request_id]
                first = sum(1 for b in blocks if b is FREED) * c.block_size
                assert all(b is not FREED for b in blocks[first // c.block_size:])
                assert (self._read(kv.block_ids(r.request_id, g), r.num_computed_tokens, first)
                        == self._truth(r)[first: r.num_computed_tokens])
        for rid, r in self.all.items():
            if r.is_finished:
                assert rid not in sched.requests and all(rid not in g.req_to_blocks for g in kv.groups)
                assert r not in sched.waiting and r not in sched.running
                if self._stops_on_eos(r):
                    assert EOS not in r.output_token_ids[:-1]  # nothing appended after the stop
            assert r.num_output_tokens <= self._max_outputs(r)
        # Every published prefix-cache entry holds the tokens its hash chain was made from.
        bs = c.block_size
        for r in self.all.values():
            hashes, seen = r.block_hashes, self._hashes_seen.get(id(r), 0)
            for i in range(seen, len(hashes)):
                toks = r.token_ids_slice(i * bs, (i + 1) * bs)
                assert len(toks) == bs and hash_block_tokens(hashes[i - 1] if i else None, toks) == hashes[i]
                self._hash_tokens[hashes[i]] = toks
            self._hashes_seen[id(r)] = len(hashes)
        for key, block_id in kv.pool._cached.items():  # a group's key: the block hash, then the group's index
            assert kv.pool.blocks[block_id].block_hash == key
            assert self.physical.get(block_id) == self._hash_tokens[key[:32]], f"cached block {block_id}"
        assert sched.num_preemptions == sum(r.num_preemptions for r in self.all.values())
        by_mode = getattr(sched, "num_preemptions_by_mode", None)
        if by_mode is not None:
            assert sum(by_mode.values()) == sched.num_preemptions
            if c.preemption_mode == "recompute":
                assert by_mode["swap"] == 0
        if hasattr(kv, "swap_space"):
            # Swapped requests are exactly the waiting ones holding CPU blocks.
            assert set(kv.swap_space.req_to_blocks) <= {r.request_id for r in waiting}


def _is_swapped(kv, r: Request) -> bool:
    return hasattr(kv, "swap_space") and kv.swap_space.holds(r.request_id)


def _swap_space_free(kv) -> bool:
    return not hasattr(kv, "swap_space") or (
        kv.swap_space.num_free_blocks == kv.swap_space.num_blocks and not kv.swap_space.req_to_blocks)


# ---- the state machine ---------------------------------------------------------------------------


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    # Small pools half the time: memory pressure (preemption, eviction) needs few blocks.
    num_blocks = draw(st.one_of(st.integers(4, 12), st.integers(4, 64)), label="num_blocks")
    # One group of full layers, one of windowed layers (Mistral), or interleaved groups (Gemma: full and
    # windowed groups, the windowed ones sometimes of two sizes).
    window = st.integers(1, 12)
    windows = draw(st.one_of(st.just((None,)), st.tuples(window),
                             st.lists(st.one_of(st.none(), window), min_size=2, max_size=3).map(tuple)),
                   label="group_windows")
    # A request of max_model_len fits alone even where every group keeps all its blocks (as the engine
    # checks at start-up).
    cap = min(num_blocks // len(windows) * block_size, 48)
    # Often as long as the cache allows, so a few requests fill it.
    max_model_len = draw(st.one_of(st.just(cap), st.integers(max(1, cap // 2), cap), st.integers(1, cap)),
                         label="max_model_len")
    max_num_seqs = draw(st.integers(1, 8), label="max_num_seqs")
    chunked = draw(st.booleans(), label="chunked")
    lo = max_num_seqs if chunked else max(max_num_seqs, max_model_len)
    max_num_batched_tokens = draw(st.integers(lo, lo + 24), label="max_num_batched_tokens")
    caching = draw(st.booleans(), label="caching")
    mode = draw(st.sampled_from(["sync", "async", "pipeline"]), label="mode")
    depth = draw(st.integers(2, 4), label="pipeline_depth") if mode == "pipeline" else 0
    # Swap preemption where the core has it; a small swap space often, so it fills and falls back.
    swap = {}
    if HAS_SWAP:
        preemption = draw(st.sampled_from(["recompute", "swap", "auto"]), label="preemption_mode")
        if preemption != "recompute":
            swap = dict(preemption_mode=preemption, num_cpu_blocks=draw(st.integers(0, 2 * num_blocks), label="cpu_blocks"),
                        swap_cost=draw(st.sampled_from([0.01, 1.0, 100.0]), label="swap_cost"))
    return Cfg(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, chunked, caching,
               mode == "async", pipeline_depth=depth, group_windows=windows, **swap)


def tokens(min_size: int, max_size: int):
    """Token lists over the small alphabet; drawn as bytes, which is much cheaper than a list of ints."""
    return st.binary(min_size=min_size, max_size=max_size).map(lambda b: [x % ALPHABET for x in b])


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.h: Harness | None = None

    @initialize(cfg=configs(), seed=st.integers(0, 2**16))
    def setup(self, cfg, seed):
        self.h = Harness(cfg, seed)

    @rule(
        data=st.data(),
        max_tokens=st.integers(1, 12),
        ignore_eos=st.booleans(),
        use_eos=st.booleans(),
    )
    def add_request(self, data, max_tokens, ignore_eos, use_eos):
        c = self.h.cfg
        # Lengths past every limit are drawn sometimes, so rejections are exercised.
        n = data.draw(st.integers(1, c.max_model_len + 3), label="prompt_len")
        prompt = data.draw(tokens(n, n), label="prompt")
        self.h.add(prompt, max_tokens, ignore_eos, use_eos)

    @rule(data=st.data(), n=st.integers(2, 5))
    def add_burst(self, data, n):
        """Several requests at once, half of them sharing a prompt, so the cache fills and hits."""
        c = self.h.cfg
        length = data.draw(st.integers(1, c.max_model_len), label="burst_len")
        shared = data.draw(tokens(length, length), label="shared")
        for i in range(n):
            prompt = shared if i % 2 == 0 else [(t + i) % ALPHABET for t in shared]
            self.h.add(prompt, data.draw(st.integers(1, 12), label="max_tokens"), data.draw(st.booleans()), True)

    @precondition(lambda self: HAS_SIBLINGS)
    @rule(data=st.data(), n=st.integers(2, 4))
    def add_siblings(self, data, n):
        """n > 1 samples of one prompt, as the engine fans them out: the later ones share the first
        one's prompt blocks by reference (caching on or off) once it has computed them."""
        c = self.h.cfg
        length = data.draw(st.integers(1, c.max_model_len), label="sibling_len")
        prompt = data.draw(tokens(length, length), label="sibling_prompt")
        first = self.h.add(prompt, data.draw(st.integers(1, 12), label="max_tokens"), True, True)
        if first is not None:
            for _ in range(n - 1):
                self.h.add(prompt, data.draw(st.integers(1, 12), label="max_tokens"), data.draw(st.booleans()), True,
                           prefix_source_id=first.request_id)

    @precondition(lambda self: self.h is not None and self.h.all)
    @rule(data=st.data())
    def add_shared_prefix_request(self, data):
        """Reuse a prefix of an earlier request's tokens: drives prefix hits on long blocks too."""
        c = self.h.cfg
        src = data.draw(st.sampled_from(sorted(self.h.all)), label="src")
        base = self.h.all[src].all_token_ids
        k = data.draw(st.integers(1, len(base)), label="prefix_len")
        extra = data.draw(tokens(0, c.block_size + 1), label="suffix")
        prompt = (base[:k] + extra)[: c.max_model_len] or [0]
        self.h.add(prompt, data.draw(st.integers(1, 8), label="max_tokens"), True, False)

    @rule()
    def step(self):
        self.h.step()

    @rule(n=st.integers(2, 6))
    def steps(self, n):
        for _ in range(n):
            self.h.step()

    # In async mode every rule below lands between a step's schedule and its update.
    @precondition(lambda self: self.h is not None and self.h.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.h.sched.requests)), label="abort")
        self.h.abort(rid)

    @precondition(lambda self: self.h is not None and self.h.sched.running)
    @rule(data=st.data())
    def stop_string_finish(self, data):
        rid = data.draw(st.sampled_from(sorted(r.request_id for r in self.h.sched.running)), label="stop")
        self.h.abort(rid, RequestStatus.FINISHED_STOPPED)

    @precondition(lambda self: self.h is not None and self.h.sched.running)
    @rule(data=st.data(), stop=st.booleans())
    def step_with_mid_step_finish(self, data, stop):
        """A finish that lands after the batch ran, before results are applied (async: before the
        previous step's update, with this step already computing for the request)."""
        rid = data.draw(st.sampled_from(sorted(r.request_id for r in self.h.sched.running)), label="mid")
        status = RequestStatus.FINISHED_STOPPED if stop else RequestStatus.FINISHED_ABORTED
        self.h.step(finish_mid_step=rid, status=status)

    @precondition(lambda self: self.h is not None and self.h.unapplied)
    @rule()
    def apply_in_flight_step(self):
        """Async: the engine applies the step in flight before scheduling the next one (it idles, or a
        request needs its full history), so sync-like and overlapped steps mix."""
        self.h.flush()

    @precondition(lambda self: self.h is not None and self.h.sched.requests)
    @rule(data=st.data())
    def add_duplicate_id(self, data):
        self.h.add_duplicate(data.draw(st.sampled_from(sorted(self.h.sched.requests)), label="dup"))

    @rule()
    def reset_prefix_cache(self):
        idle = self.h.kv.pool.num_free_blocks == self.h.cfg.num_blocks
        assert self.h.kv.reset_prefix_cache() == idle
        if idle:
            assert self.h.kv.pool._cached == {}
        self.h.check()

    @invariant()
    def invariants(self):
        if self.h is not None:
            self.h.check()

    def teardown(self):
        if self.h is not None:
            self.h.drain()


SchedulerMachine.TestCase.settings = settings(
    max_examples=450,  # a third each sync, async and pipelined (configs() draws the mode)
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_scheduler_state_machine = SchedulerMachine.TestCase


# ---- deterministic scenarios -----------------------------------------------------------------------


def test_preemption_happens_and_everything_finishes():
    cfg = Cfg(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=24,
              chunked=True, caching=True)
    h = Harness(cfg, seed=1)
    reqs = [h.add([i % ALPHABET] * 10 + [1, 2], max_tokens=10, ignore_eos=True, use_eos=False) for i in range(4)]
    h.drain()
    assert h.sched.num_preemptions > 0
    assert sum(r.num_preemptions for r in reqs) == h.sched.num_preemptions
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.num_output_tokens == 10


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [True, False])
def test_preemption_without_chunking_or_caching(chunked, caching):
    cfg = Cfg(num_blocks=5, block_size=2, max_num_seqs=3, max_num_batched_tokens=10, max_model_len=10,
              chunked=chunked, caching=caching)
    h = Harness(cfg, seed=2)
    reqs = [h.add([0, 1, 2, 0][: 2 + i], max_tokens=8, ignore_eos=True, use_eos=False) for i in range(3)]
    h.drain()
    assert h.sched.num_preemptions > 0
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.num_tokens == min(r.num_prompt_tokens + 8, cfg.max_model_len)


def test_chunked_prefill_splits_50_tokens_16_16_16_2():
    cfg = Cfg(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              chunked=True, caching=False)
    h = Harness(cfg)
    r = h.add([t % ALPHABET for t in range(50)], max_tokens=3, ignore_eos=True, use_eos=False)
    chunks, samples = [], []
    while r.num_output_tokens == 0:
        out = h.step()
        (s,) = out.scheduled
        chunks.append(len(s.token_ids))
        samples.append(s.needs_sample)
        assert out.total_num_scheduled_tokens == len(s.token_ids)
    assert chunks == [16, 16, 16, 2]
    assert samples == [False, False, False, True]
    h.drain()
    assert r.num_output_tokens == 3


def test_decodes_take_budget_before_prefill_chunks():
    cfg = Cfg(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              chunked=True, caching=False)
    h = Harness(cfg)
    d = h.add([1, 2, 3], max_tokens=30, ignore_eos=True, use_eos=False)
    h.step()  # d's prefill: now it decodes one token a step
    assert d.num_output_tokens == 1
    r = h.add([t % ALPHABET for t in range(50)], max_tokens=2, ignore_eos=True, use_eos=False)
    chunks, samples = [], []
    while r.num_output_tokens == 0:
        out = h.step()
        assert [s.request_id for s in out.scheduled] == [d.request_id, r.request_id]
        assert len(out.scheduled[0].token_ids) == 1 and out.scheduled[0].needs_sample
        chunks.append(len(out.scheduled[1].token_ids))
        samples.append(out.scheduled[1].needs_sample)
        assert out.total_num_scheduled_tokens == 1 + chunks[-1] <= 16
    assert chunks == [15, 15, 15, 5]
    assert samples == [False, False, False, True]
    h.drain()


def test_prefill_without_chunking_waits_for_budget():
    cfg = Cfg(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16,
              chunked=False, caching=False)
    h = Harness(cfg)
    d = h.add([1, 2, 3], max_tokens=5, ignore_eos=True, use_eos=False)
    h.step()
    r = h.add([0] * 16, max_tokens=1, ignore_eos=True, use_eos=False)
    out = h.step()  # d's decode takes 1 of 16: the 16-token prompt must wait
    assert [s.request_id for s in out.scheduled] == [d.request_id]
    h.drain()
    assert r.num_output_tokens == 1
    with pytest.raises(ValueError):
        h.sched.add_request(Request("too-long", [0] * 17, Params(1)))


def test_prefix_hit_in_scheduler_reports_cached_tokens():
    cfg = Cfg(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40,
              chunked=True, caching=True)
    h = Harness(cfg)
    prompt = [t % ALPHABET for t in range(13)]
    a = h.add(prompt, max_tokens=2, ignore_eos=True, use_eos=False)
    h.drain()
    b = h.add(prompt, max_tokens=2, ignore_eos=True, use_eos=False)
    out = h.step()
    (s,) = out.scheduled
    assert s.start_pos == 12 and s.token_ids == prompt[12:]
    assert b.num_cached_tokens == 12 and a.num_cached_tokens == 0
    h.drain()


def test_max_model_len_caps_output():
    cfg = Cfg(num_blocks=8, block_size=2, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=6,
              chunked=True, caching=True)
    h = Harness(cfg)
    r = h.add([0, 1, 2, 3], max_tokens=100, ignore_eos=True, use_eos=False)
    full = h.add([0] * 6, max_tokens=100, ignore_eos=True, use_eos=False)
    h.drain()
    assert r.num_tokens == 6 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert full.num_output_tokens == 1 and full.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_abort_waiting_and_running():
    cfg = Cfg(num_blocks=4, block_size=2, max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8,
              chunked=True, caching=True)
    h = Harness(cfg)
    a = h.add([0, 1, 2], max_tokens=4, ignore_eos=True, use_eos=False)
    b = h.add([0, 1, 3], max_tokens=4, ignore_eos=True, use_eos=False)
    h.step()
    assert h.sched.running == [a] and list(h.sched.waiting) == [b]
    h.abort(b.request_id)
    assert b.status == RequestStatus.FINISHED_ABORTED and not h.sched.waiting
    h.abort(a.request_id)
    assert not h.sched.has_unfinished_requests()
    out = h.step()
    assert out.is_empty and set(out.finished_req_ids) == {a.request_id, b.request_id}
    h.check_all_done()
    # Unknown and already finished ids are ignored.
    h.sched.finish_requests(["nope", a.request_id], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED


def test_check_fits_rejections():
    kv = KVCacheManager(4, 4)  # 16 tokens of KV cache
    # A config the engine would refuse (budget < max_model_len without chunking), but the core
    # still has to reject prompts that could never be scheduled rather than let them wait forever.
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=20,
                                      enable_chunked_prefill=False), kv)
    for n, ok in [(8, True), (9, False), (21, False)]:
        r = Request(f"n{n}", [0] * n, Params(1))
        if ok:
            sched.add_request(r)
        else:
            with pytest.raises(ValueError):
                sched.add_request(r)
        assert (r.request_id in sched.requests) == ok and (r in sched.waiting) == ok
    chunked = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=20),
                        KVCacheManager(4, 4))
    chunked.add_request(Request("a", [0] * 16, Params(1)))  # longer than the budget: chunked
    with pytest.raises(ValueError, match="KV cache"):
        chunked.add_request(Request("b", [0] * 17, Params(1)))  # fits max_model_len, not the cache
    assert "b" not in chunked.requests
    with pytest.raises(ValueError, match="already in use"):
        chunked.add_request(Request("a", [0], Params(1)))


def test_request_id_reusable_after_finish():
    cfg = Cfg(num_blocks=8, block_size=2, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=8,
              chunked=True, caching=True)
    h = Harness(cfg)
    sched = h.sched
    old = Request("x", [0, 1, 2], Params(4))
    sched.add_request(old)
    out = sched.schedule()
    sched.update(out, {"x": [1]})
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    new = Request("x", [0, 1, 2, 3, 0], Params(1))
    sched.add_request(new)  # the id is free again once the old request finished
    out = sched.schedule()
    # The runner hears about the old "x" finishing before it sees the new "x" as a new request.
    assert out.finished_req_ids == ["x"]
    (s,) = out.scheduled
    assert s.is_new and s.request_id == "x" and s.start_pos == 2  # one cached block of the old "x"
    assert s.token_ids == [2, 3, 0]
    sched.update(out, {"x": [0]})
    assert new.is_finished and old.num_output_tokens == 1 and new.num_output_tokens == 1
    h.kv.check_invariants()
    assert h.kv.pool.num_free_blocks == cfg.num_blocks


# ---- async scheduling -------------------------------------------------------------------------------


def _async(cfg: Cfg) -> Cfg:
    return dataclasses.replace(cfg, async_scheduling=True, pipeline_depth=0)


def _run_workload(cfg: Cfg, first: list, later: list, later_after: int = 3) -> tuple[Harness, dict]:
    """Runs (prompt, max_tokens, ignore_eos) requests with the content-determined "model"; `later` arrive
    after a few steps. Returns the harness and each request's (output tokens, final status)."""
    h = Harness(cfg, token_fn=content_token)
    for prompt, max_tokens, ignore_eos in first:
        h.add(prompt, max_tokens, ignore_eos, use_eos=True)
    for _ in range(later_after):
        h.step()
    for prompt, max_tokens, ignore_eos in later:
        h.add(prompt, max_tokens, ignore_eos, use_eos=True)
    h.drain()
    return h, {rid: (r.output_token_ids, r.status) for rid, r in h.all.items()}


def _check_same_tokens(cfg: Cfg, first: list, later: list = ()) -> tuple[Harness, Harness]:
    sync_h, sync_out = _run_workload(dataclasses.replace(cfg, async_scheduling=False, pipeline_depth=0), first,
                                     list(later))
    async_h, async_out = _run_workload(_async(cfg), first, list(later))
    assert async_out == sync_out
    for depth in (2, 3):  # pipeline parallelism: batches in flight, each request in one at most
        _, pipelined_out = _run_workload(dataclasses.replace(cfg, async_scheduling=False, pipeline_depth=depth),
                                         first, list(later))
        assert pipelined_out == sync_out
    for r in async_h.all.values():
        if r.sampling_params.ignore_eos:
            assert r.num_output_tokens == async_h._max_outputs(r)  # min(max_tokens, max_model_len - prompt)
    return sync_h, async_h


@st.composite
def workloads(draw):
    cfg = draw(configs())
    pool = draw(st.lists(tokens(1, cfg.max_model_len), min_size=1, max_size=3), label="prompt_pool")

    def requests(max_size):
        # Prompts from a small pool, some extended: prefix hits; the rest of the limits are the config's.
        return draw(st.lists(st.tuples(st.sampled_from(pool), tokens(0, 6), st.integers(1, 10), st.booleans())
                             .map(lambda t: ((t[0] + t[1])[: cfg.max_model_len], t[2], t[3])),
                             min_size=1, max_size=max_size))

    return cfg, requests(6), requests(3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_async_gives_the_same_tokens_as_sync(workload):
    """Sampled tokens depend only on what each request attends to, so both loops must agree exactly,
    stops on EOS included, whatever preemption, chunking and prefix hits each of them went through."""
    cfg, first, later = workload
    _check_same_tokens(cfg, first, later)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [True, False])
def test_async_same_tokens_with_preemption_chunks_and_prefix_hits(chunked, caching):
    budget = 6 if chunked else 20
    cfg = Cfg(num_blocks=10, block_size=2, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=20,
              chunked=chunked, caching=caching)
    shared = [0, 1, 2, 0, 1, 2, 0, 1, 2]
    first = [(shared + [i % ALPHABET], 8, True) for i in range(4)] + [(shared[:5], 30, True), ([2, 2], 3, False)]
    later = [(shared + [3, 3], 5, True), (shared[:4], 9, True)]
    sync_h, async_h = _check_same_tokens(cfg, first, later)
    for h in (sync_h, async_h):
        assert h.sched.num_preemptions > 0
        if caching:
            assert h.kv.prefix_cache_stats.hits > 0
    # Async steps really overlapped: chunks computed tokens sampled by the step still in flight.
    assert async_h.num_placeholders > 0 and sync_h.num_placeholders == 0


def _sched(num_blocks=16, block_size=2, max_num_seqs=4, budget=16, max_model_len=32, caching=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len),
                     KVCacheManager(num_blocks, block_size, enable_caching=caching))


def test_async_decode_computes_the_token_in_flight():
    sched = _sched()
    r = Request("a", [0, 1, 2], Params(3))
    sched.add_request(r)
    out1 = sched.schedule()
    (s1,) = out1.scheduled
    assert s1.token_ids == [0, 1, 2] and s1.needs_sample and s1.output_len == 0
    assert r.num_computed_tokens == 3 and r.num_pending_outputs == 1
    out2 = sched.schedule()  # before out1's token is known: the runner fills in the placeholder
    (s2,) = out2.scheduled
    assert s2.token_ids == [PLACEHOLDER_TOKEN_ID] and s2.start_pos == 3 and s2.needs_sample and s2.output_len == 1
    assert r.num_computed_tokens == 4 and r.num_pending_outputs == 2 and r.num_tokens == 3
    assert sched.update(out1, {"a": [1]}) == [r]
    assert r.output_token_ids == [1] and r.num_pending_outputs == 1 and r.num_computed_tokens == 4
    out3 = sched.schedule()  # the third token is the last one allowed: sampled, then nothing more
    (s3,) = out3.scheduled
    assert s3.token_ids == [PLACEHOLDER_TOKEN_ID] and s3.start_pos == 4 and s3.output_len == 2
    sched.update(out2, {"a": [2]})
    out4 = sched.schedule()
    assert out4.is_empty and r.num_pending_outputs == 1 and sched.has_unfinished_requests()
    sched.update(out3, {"a": [0]})
    assert r.output_token_ids == [1, 2, 0] and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.schedule().finished_req_ids == ["a"]
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_async_never_schedules_past_max_tokens_or_max_model_len(max_tokens):
    for max_model_len in (8, 5 + max_tokens):  # capped by max_model_len, then by max_tokens
        cfg = Cfg(num_blocks=16, block_size=2, max_num_seqs=2, max_num_batched_tokens=16,
                  max_model_len=max_model_len, chunked=True, caching=False, async_scheduling=True)
        h = Harness(cfg)
        r = h.add([0, 1, 2, 0, 1], max_tokens=max_tokens, ignore_eos=True, use_eos=False)
        computing_steps = 0
        while r.num_output_tokens + r.num_pending_outputs < h._max_outputs(r):
            assert h.num_steps < 20, "no progress"
            computing_steps += bool(h.step().scheduled)
        assert computing_steps == h._max_outputs(r)  # one step per token, and no wasted step after
        assert not h.step().scheduled  # its last token is in flight: nothing to compute
        h.drain()
        assert r.num_output_tokens == h._max_outputs(r) and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_async_result_of_aborted_request_is_dropped_even_if_its_id_is_reused():
    sched = _sched()
    old = Request("x", [0, 1, 2], Params(4))
    sched.add_request(old)
    out1 = sched.schedule()
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)  # while step 1 runs
    new = Request("x", [0, 1, 2, 3, 0], Params(2))
    sched.add_request(new)
    out2 = sched.schedule()
    assert out2.finished_req_ids == ["x"] and out2.scheduled[0].is_new
    assert sched.update(out1, {"x": [1]}) == []  # old "x"'s token: not new "x"'s
    assert old.output_token_ids == [] and new.output_token_ids == [] and new.num_pending_outputs == 1
    assert sched.update(out2, {"x": [2]}) == [new] and new.output_token_ids == [2]
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    sched.kv.check_invariants()
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("in_flight_token", [EOS, 0])
def test_async_request_preempted_while_its_step_is_in_flight(in_flight_token):
    """B is preempted by step 2 while step 1 (which samples for B) is in flight. Step 1's token then
    either stops B while it waits (it leaves the queue) or joins what B recomputes on resumption."""
    sched = _sched(num_blocks=3, block_size=2, max_num_seqs=2, budget=8, max_model_len=6, caching=False)
    a = Request("a", [0, 1], Params(3))
    b = Request("b", [0, 2], Params(3, ignore_eos=False), eos_token_id=EOS)
    sched.add_request(a)
    sched.add_request(b)
    out1 = sched.schedule()
    assert [s.request_id for s in out1.scheduled] == ["a", "b"]
    out2 = sched.schedule()  # a's decode needs the last free block: b, the newest, is preempted
    assert [s.request_id for s in out2.scheduled] == ["a"] and out2.preempted_req_ids == ["b"]
    assert list(sched.waiting) == [b] and b.num_pending_outputs == 1 and b.num_computed_tokens == 0
    sched.update(out1, {"a": [1], "b": [in_flight_token]})
    assert b.output_token_ids == [in_flight_token] and b.num_pending_outputs == 0
    if in_flight_token == EOS:
        assert b.status == RequestStatus.FINISHED_STOPPED and not sched.waiting and "b" not in sched.requests
        assert sched.schedule().finished_req_ids == ["b"]
    else:
        assert list(sched.waiting) == [b] and b.status == RequestStatus.PREEMPTED
        out3 = sched.schedule()
        assert [s.request_id for s in out3.scheduled] == ["a"]  # no room for b while a runs
        sched.update(out2, {"a": [2]})
        assert sched.schedule().is_empty  # a's last token is in flight; b still does not fit
        sched.update(out3, {"a": [0]})
        assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
        (s,) = sched.schedule().scheduled  # b resumes: its prompt and the token sampled in flight
        assert s.request_id == "b" and s.is_new and s.start_pos == 0 and s.token_ids == [0, 2, in_flight_token]
    sched.kv.check_invariants()


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])
def test_async_finish_between_schedule_and_update(status):
    """A stop string or an abort lands while a step computes for the request: its result is dropped,
    its blocks are freed once, and the runner hears of it in the next step."""
    cfg = Cfg(num_blocks=8, block_size=2, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16,
              chunked=True, caching=True, async_scheduling=True)
    h = Harness(cfg, seed=3)
    a = h.add([0, 1, 2], max_tokens=6, ignore_eos=True, use_eos=False)
    b = h.add([1, 2, 3], max_tokens=6, ignore_eos=True, use_eos=False)
    h.step()
    h.step()  # a and b each have a step in flight, the previous one applied
    assert a.num_pending_outputs == b.num_pending_outputs == 1 and a.num_output_tokens == 1
    h.step(finish_mid_step=a.request_id, status=status)  # after step 3 was scheduled, before step 2's update
    assert a.status == status and a.num_output_tokens == 1 and a.num_pending_outputs == 2
    h.abort(b.request_id, status)  # after step 3's schedule, before its update
    assert b.num_output_tokens == 2
    out = h.step()
    assert out.is_empty and set(out.finished_req_ids) == {a.request_id, b.request_id}
    h.drain()
    assert a.num_output_tokens == 1 and b.num_output_tokens == 2


# ---- swap preemption --------------------------------------------------------------------------------


SWAP_WORKLOAD = [([i % ALPHABET] * 9 + [1, 2, i % 3], 14, True) for i in range(5)]


@pytest.mark.skipif(not HAS_SWAP, reason="this core has no swap preemption")
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode,cpu_blocks,swap_cost", [
    ("swap", 64, 1.0), ("swap", 1, 1.0), ("auto", 64, 0.01), ("auto", 64, 100.0), ("auto", 64, 2.5)])
def test_swap_gives_the_same_tokens_as_recompute(async_scheduling, mode, cpu_blocks, swap_cost):
    """Under heavy preemption (6 blocks of 4 tokens for 5 requests of up to 24 tokens), swapping, swapping
    into a swap space too small for everyone (falls back to recompute), and auto at costs that favour
    either side all produce the tokens recompute does; no block leaks on either side."""
    base = Cfg(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=24,
               chunked=True, caching=True, async_scheduling=async_scheduling)
    recompute_h, recompute_out = _run_workload(base, SWAP_WORKLOAD, [])
    cfg = dataclasses.replace(base, preemption_mode=mode, num_cpu_blocks=cpu_blocks, swap_cost=swap_cost)
    h, out = _run_workload(cfg, SWAP_WORKLOAD, [])
    assert out == recompute_out
    assert recompute_h.sched.num_preemptions > 0 and h.sched.num_preemptions > 0
    by_mode = h.sched.num_preemptions_by_mode
    if mode == "swap" and cpu_blocks == 64 or (mode == "auto" and swap_cost == 0.01):
        assert by_mode["swap"] == h.sched.num_preemptions and h.num_swapped_out > 0
        assert h.num_swapped_in == h.num_swapped_out  # every swapped block came back (all requests finished)
    if mode == "swap" and cpu_blocks == 1:
        assert by_mode["recompute"] > 0  # the swap space filled up
    if mode == "auto" and swap_cost == 100.0:
        assert by_mode["swap"] == 0  # copying a block costs more than recomputing up to 24 tokens
    h.kv.check_invariants()


@pytest.mark.skipif(not HAS_SWAP, reason="this core has no swap preemption")
def test_auto_chooses_by_cost_per_victim():
    """auto swaps a victim when copying its blocks both ways (blocks x swap cost) is cheaper than
    recomputing its tokens (tokens x recompute cost)."""
    kv = KVCacheManager(8, 4, num_cpu_blocks=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32,
                                      preemption_mode="auto", recompute_seconds_per_token=1.0,
                                      swap_seconds_per_block=3.0), kv)
    short, long_ = Request("short", [0] * 3, Params(8)), Request("long", [1] * 13, Params(8))
    sched.add_request(short)
    sched.add_request(long_)
    out = sched.schedule()
    assert kv.num_blocks_held(short) == 1 and kv.num_blocks_held(long_) == 4
    # short: 3 tokens x 1.0 = 3 vs 1 block x 3.0 = 3: not cheaper, recompute.
    # long: 13 tokens x 1.0 = 13 vs 4 blocks x 3.0 = 12: swap.
    assert sched._preemption_mode(short) == "recompute" and sched._preemption_mode(long_) == "swap"
    sched.update(out, {"short": [0], "long": [0]})
    sched.running.remove(long_)
    sched._preempt(long_, out)
    assert kv.is_swapped(long_) and long_.num_computed_tokens == 13
    assert out.blocks_to_swap_out == list(zip([1, 2, 3, 4], kv.swap_space.req_to_blocks["long"]))
    event = out.preemptions[-1]
    assert (event.mode, event.num_tokens, event.num_blocks) == ("swap", 13, 4)
    sched.finish_requests(["long"], RequestStatus.FINISHED_ABORTED)  # aborted while swapped: CPU blocks freed
    assert kv.swap_space.num_free_blocks == 8
    kv.check_invariants()


# ---- speculative decoding: lookahead slots and rollback ------------------------------------------
class SpecRun:
    """A Scheduler driven with draft tokens (sync loop, as the engine runs with a proposer): every step
    offers each running request 0..4 drafts, each right (what the content model samples next) or wrong;
    a fake runner writes every scheduled token's K/V into a simulated cache, checks each read and verifies
    greedily (the longest matching prefix plus one). After every operation: block ref counts match the
    tables holding them, nothing is freed twice, a running request holds exactly the blocks of its
    computed tokens, and the prefix cache holds only tokens that were accepted."""

    def __init__(self, cfg: Cfg, rng: random.Random, drafts: bool):
        self.cfg, self.rng, self.drafts = cfg, rng, drafts
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size, enable_caching=cfg.caching,
                                 num_cpu_blocks=cfg.num_cpu_blocks)
        swap = dict(preemption_mode=cfg.preemption_mode, recompute_seconds_per_token=cfg.recompute_cost,
                    swap_seconds_per_block=cfg.swap_cost)
        self.sched = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
                                               cfg.chunked, **swap), self.kv)
        self.physical: dict[int, list] = {}
        self.cpu_physical: dict[int, list] = {}
        self.all: list[Request] = []
        self.tables: dict[str, list[int]] = {}  # the runner's view of each block table

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        r = Request(rid, list(prompt), Params(max_tokens, ignore_eos=False), eos_token_id=EOS)
        try:
            self.sched.add_request(r)
        except ValueError:
            return
        self.all.append(r)

    def _offer(self) -> None:
        offers = {}
        for r in self.sched.running:
            seq = r.all_token_ids
            tokens = []
            for _ in range(self.rng.randint(0, 4)):
                right = content_token(r.request_id, seq)
                tok = right if self.rng.random() < 0.7 else (right + 1) % ALPHABET
                tokens.append(tok)
                seq = seq + [tok]
            offers[r.request_id] = tokens
        self.sched.update_draft_token_ids(offers)

    def step(self) -> None:
        if self.drafts:
            self._offer()
        out = self.sched.schedule()
        c, bs = self.cfg, self.cfg.block_size
        assert out.total_num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.total_num_scheduled_tokens <= c.max_num_batched_tokens
        for rid in out.finished_req_ids + out.preempted_req_ids:
            self.tables.pop(rid, None)
        for rid, num_blocks in out.trimmed_block_tables.items():
            if rid in self.tables:
                del self.tables[rid][num_blocks:]
        for gpu, cpu in out.blocks_to_swap_out:
            self.cpu_physical[cpu] = list(self.physical.get(gpu, [None] * bs))
        for gpu, cpu in out.blocks_to_swap_in:
            self.physical[gpu] = list(self.cpu_physical[cpu])
        sampled = {}
        for s in out.scheduled:
            r = s.request
            (new_ids,) = s.new_block_ids  # one KV cache group
            self.tables[s.request_id] = list(new_ids) if s.is_new else self.tables[s.request_id] + new_ids
            table = self.tables[s.request_id]
            assert table == self.kv.block_ids(s.request_id)
            k = len(s.spec_token_ids)
            end = s.start_pos + len(s.token_ids)
            if k:  # drafts only after the last known token, within the caps, in their lookahead slots
                assert s.needs_sample and s.token_ids[-k:] == s.spec_token_ids
                assert end - k == r.num_tokens and end <= c.max_model_len
                assert r.num_output_tokens + k + 1 <= r.sampling_params.max_tokens
            assert len(table) == cdiv(end, bs)
            for i, tok in enumerate(s.token_ids):
                pos = s.start_pos + i
                self.physical.setdefault(table[pos // bs], [None] * bs)[pos % bs] = tok
        for s in out.scheduled:
            r, table = s.request, self.tables[s.request_id]
            end = s.start_pos + len(s.token_ids)
            k = len(s.spec_token_ids)
            attended = [self.physical.get(table[p // bs], [None] * bs)[p % bs] for p in range(end)]
            assert attended == r.all_token_ids[:end - k] + list(s.spec_token_ids), f"{s.request_id} reads wrong K/V"
            if not s.needs_sample:
                continue
            new = []
            for i in range(k + 1):  # greedy verification: sample at each draft position
                tok = content_token(s.request_id, attended[:end - k + i])
                new.append(tok)
                if i == k or tok != s.spec_token_ids[i]:
                    break
            sampled[s.request_id] = new
        before = {s.request_id: s.request.num_output_tokens for s in out.scheduled}
        self.sched.update(out, sampled)
        for s in out.scheduled:
            r = s.request
            if s.request_id not in sampled:
                continue
            n_out = before[s.request_id]
            appended = r.output_token_ids[n_out:]
            assert appended == sampled[s.request_id][:len(appended)] and appended
            if len(appended) < len(sampled[s.request_id]):  # a stop in the middle drops the rest
                assert r.is_finished
            if r.status == RequestStatus.RUNNING:
                # The rejected drafts' K/V is forgotten: all but the newest token is computed.
                assert r.num_computed_tokens == r.num_tokens - 1
                assert len(self.kv.block_ids(r.request_id)) == cdiv(r.num_computed_tokens, bs)
        self.check()

    def check(self) -> None:
        kv, bs = self.kv, self.cfg.block_size
        kv.check_invariants()  # every ref count equals the tables holding the block; none in two places
        held = {b.block_id for blocks in kv.groups[0].req_to_blocks.values() for b in blocks}
        assert kv.pool.num_free_blocks + len(held) == self.cfg.num_blocks  # nothing leaked
        for r in self.sched.running:
            assert not r.num_spec_in_flight
            table = kv.block_ids(r.request_id)
            computed = [self.physical.get(table[p // bs], [None] * bs)[p % bs] for p in range(r.num_computed_tokens)]
            assert computed == r.all_token_ids[:r.num_computed_tokens]
        # A published block holds exactly the (accepted) tokens its hash was made from.
        contents = {}
        for r in self.all:
            for i, h in enumerate(r.block_hashes):
                contents[h] = r.token_ids_slice(i * bs, (i + 1) * bs)
        for block_hash, block_id in kv.pool._cached.items():
            assert self.physical.get(block_id) == contents[block_hash], f"cached block {block_id}"

    def run(self, limit: int) -> dict[str, list[int]]:
        steps = 0
        while self.sched.has_unfinished_requests():
            steps += 1
            assert steps <= limit, "livelock"
            self.step()
        self.sched.schedule()  # reports the last finishes
        assert self.kv.pool.num_free_blocks == self.cfg.num_blocks and self.kv.groups[0].req_to_blocks == {}
        assert _swap_space_free(self.kv)
        return {r.request_id: r.output_token_ids for r in self.all}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), seed=st.integers(0, 2**16), data=st.data())
def test_drafts_with_lookahead_and_rollback_keep_outputs_and_blocks(cfg, seed, data):
    """The same requests with and without drafts: identical outputs (the content model is greedy), and
    no block leaked or freed twice on the way, with preemption, swapping, chunking and prefix hits."""
    cfg = dataclasses.replace(cfg, async_scheduling=False, pipeline_depth=0)
    n = data.draw(st.integers(1, 5), label="num_requests")
    reqs = []
    for i in range(n):
        length = data.draw(st.integers(1, cfg.max_model_len), label="prompt_len")
        reqs.append((f"r{i}", data.draw(tokens(length, length), label="prompt"),
                     data.draw(st.integers(1, 12), label="max_tokens")))
    outputs = []
    for drafts in (False, True):
        run = SpecRun(cfg, random.Random(seed), drafts)
        for rid, prompt, max_tokens in reqs:
            run.add(rid, prompt, max_tokens)
        outputs.append(run.run(limit=50 + 30 * sum(len(p) + m for _, p, m in reqs)))
        if drafts:
            assert run.sched.num_accepted_tokens <= run.sched.num_draft_tokens
    assert outputs[0] == outputs[1]
