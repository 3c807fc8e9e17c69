"""Property tests: a real Scheduler + KVCacheManager driven by random operation sequences.

A fake model runner keeps a simulated physical KV cache (block id -> slot -> token) so that
prefix-cache hits, evictions and block-table bookkeeping are checked against the token contents
each request would actually attend to, not only against the manager's own counters.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.core.kv_cache_manager import KVCacheManager, cdiv
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

ALPHABET = 4  # tokens 0..3: prompts collide often, so prefix hits happen
EOS = 3


# n > 1 sibling sharing (Request.prefix_source_id), where this version of the core has it.
HAS_SIBLINGS = "prefix_source_id" in Request.__dataclass_fields__


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


class Harness:
    """Scheduler + KV manager + a fake runner, with every invariant checked after each operation."""

    def __init__(self, cfg: Cfg, seed: int = 0):
        self.cfg = cfg
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size, enable_caching=cfg.caching)
        self.sched = Scheduler(
            SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=cfg.max_model_len,
                enable_chunked_prefill=cfg.chunked,
            ),
            self.kv,
        )
        self.rng = random.Random(seed)
        self.all: dict[str, Request] = {}  # every accepted request, finished ones included
        self.rejected: list[str] = []
        self.physical: dict[int, list] = {}  # simulated KV: block id -> per-slot token (None = never written)
        self.runner_tables: dict[str, list[int]] = {}  # the runner's view of each block table
        self.last_out: SchedulerOutput | None = None
        self.reported_finished: set[str] = set()
        self.num_steps = 0
        self.budget_steps = 100
        self._next_id = 0
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
            or len(prompt) > c.num_blocks * c.block_size
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

    def add_duplicate(self, rid: str) -> None:
        r = self.sched.requests[rid]
        before = (list(self.sched.waiting), list(self.sched.running))
        with pytest.raises(ValueError):
            self.sched.add_request(Request(rid, [0], Params(1)))
        assert self.sched.requests[rid] is r
        assert (list(self.sched.waiting), list(self.sched.running)) == before

    def step(self, abort_mid_step: str | None = None) -> SchedulerOutput:
        had_work = self.sched.has_unfinished_requests()
        was_running, was_waiting = list(self.sched.running), list(self.sched.waiting)
        out = self.sched.schedule()
        self.last_out = out
        self.num_steps += 1
        self._check_output(out, had_work, was_running, was_waiting)
        self._run_model(out)
        sampled = {s.request_id: self.rng.randrange(ALPHABET) for s in out.scheduled if s.needs_sample}
        if abort_mid_step is not None and abort_mid_step in self.sched.requests:
            # An abort that lands after the batch ran but before its results are applied.
            self.sched.finish_requests([abort_mid_step], RequestStatus.FINISHED_ABORTED)
        before = {s.request_id: (self.all[s.request_id].num_computed_tokens, self.all[s.request_id].num_output_tokens)
                  for s in out.scheduled}
        touched = self.sched.update(out, sampled)
        for s in out.scheduled:
            r = self.all[s.request_id]
            computed, n_out = before[s.request_id]
            if r.status == RequestStatus.FINISHED_ABORTED and s.request_id == abort_mid_step:
                assert r not in touched
                continue
            assert r.num_computed_tokens == computed + len(s.token_ids)
            if s.needs_sample:
                assert r in touched
                assert r.num_output_tokens == n_out + 1 and r.output_token_ids[-1] == sampled[s.request_id]
                assert r.num_computed_tokens == r.num_tokens - 1
            else:
                assert r not in touched and r.num_output_tokens == n_out
        for r in touched:
            if r.is_finished:
                self._check_finish_reason(r)
        self.check()
        return out

    def abort(self, rid: str, status=RequestStatus.FINISHED_ABORTED) -> None:
        r = self.sched.requests[rid]
        self.sched.finish_requests([rid], status)
        assert r.status == status
        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)  # a second finish is a no-op
        assert r.status == status
        self.check()

    def drain(self) -> None:
        while self.sched.has_unfinished_requests():
            assert self.num_steps <= self.budget_steps, (
                f"livelock: {self.num_steps} steps, waiting={[r.request_id for r in self.sched.waiting]}, "
                f"running={[r.request_id for r in self.sched.running]}"
            )
            self.step()
        self.check_all_done()

    def check_all_done(self) -> None:
        assert self.kv.pool.num_free_blocks == self.cfg.num_blocks
        assert self.kv.req_to_blocks == {}
        assert self.sched.requests == {}
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        for r in self.all.values():
            assert r.is_finished, r
            assert r.num_output_tokens <= r.sampling_params.max_tokens
            assert r.num_tokens <= max(self.cfg.max_model_len, r.num_prompt_tokens + 1)

    # ---- the fake runner -------------------------------------------------------------------------
    def _run_model(self, out: SchedulerOutput) -> None:
        bs = self.cfg.block_size
        for rid in out.finished_req_ids + out.preempted_req_ids:
            self.runner_tables.pop(rid, None)
        for s in out.scheduled:
            if s.is_new:
                self.runner_tables[s.request_id] = list(s.new_block_ids)
            else:
                assert s.request_id in self.runner_tables, "continuing request unknown to the runner"
                self.runner_tables[s.request_id] += s.new_block_ids
            # The runner's incrementally built table matches the manager's.
            assert self.runner_tables[s.request_id] == self.kv.block_ids(s.request_id)
        # All K/V writes of the step, then all reads (attention), as in one forward pass.
        for s in out.scheduled:
            table = self.runner_tables[s.request_id]
            for k, tok in enumerate(s.token_ids):
                pos = s.start_pos + k
                slots = self.physical.setdefault(table[pos // bs], [None] * bs)
                slots[pos % bs] = tok
        for s in out.scheduled:
            r = self.all[s.request_id]
            end = s.start_pos + len(s.token_ids)
            assert self._read(self.runner_tables[s.request_id], end) == r.token_ids_slice(0, end), (
                f"{s.request_id} would attend to wrong K/V"
            )

    def _read(self, table: list[int], n: int) -> list:
        bs = self.cfg.block_size
        return [self.physical.get(table[p // bs], [None] * bs)[p % bs] for p in range(n)]

    # ---- checks ----------------------------------------------------------------------------------
    def _check_output(
        self, out: SchedulerOutput, had_work: bool, was_running: list[Request], was_waiting: list[Request]
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
        # Progress: any unfinished work means something is scheduled (no empty step, no deadlock).
        if had_work:
            assert out.scheduled, "unfinished requests but nothing scheduled"
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
        for s in out.scheduled:
            r = self.all[s.request_id]
            assert r.status == RequestStatus.RUNNING
            assert s.start_pos == r.num_computed_tokens
            assert s.token_ids == r.token_ids_slice(s.start_pos, s.start_pos + len(s.token_ids))
            assert s.start_pos + len(s.token_ids) <= r.num_tokens
            assert s.needs_sample == (s.start_pos + len(s.token_ids) == r.num_tokens)
            assert s.output_len == r.num_output_tokens
            assert len(self.kv.block_ids(s.request_id)) * c.block_size >= s.start_pos + len(s.token_ids)
            # No more blocks than needed for what will be computed.
            assert len(self.kv.block_ids(s.request_id)) == cdiv(s.start_pos + len(s.token_ids), c.block_size)
            if not c.chunked:
                # Without chunked prefill a prompt (or a resumed request) is computed in one go.
                assert s.needs_sample
            if s.is_new and not c.caching and getattr(r, "prefix_source_id", None) is None:
                assert s.start_pos == 0  # nothing to reuse without the prefix cache or a sibling
            if s.is_new and c.caching:
                assert s.start_pos % c.block_size == 0 and s.start_pos < r.num_tokens

    def _check_finish_reason(self, r: Request) -> None:
        p = r.sampling_params
        if r.status == RequestStatus.FINISHED_STOPPED:
            assert not p.ignore_eos and r.eos_token_id is not None and r.output_token_ids[-1] == EOS
        elif r.status == RequestStatus.FINISHED_LENGTH_CAPPED:
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
        # Every block is either free or held by some request table.
        held = {b.block_id for blocks in kv.req_to_blocks.values() for b in blocks}
        assert kv.pool.num_free_blocks + len(held) == c.num_blocks
        assert set(kv.pool._free).isdisjoint(held)
        # Only running requests hold blocks (waiting/preempted/finished ones hold none).
        assert set(kv.req_to_blocks) <= {r.request_id for r in running}
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0
            assert r.request_id not in kv.req_to_blocks
        for r in running:
            assert r.status == RequestStatus.RUNNING
            table = kv.block_ids(r.request_id)
            assert len(table) * c.block_size >= r.num_computed_tokens and table
            assert r.num_computed_tokens < r.num_tokens  # always something left to schedule
            assert r.num_computed_tokens <= c.max_model_len
            # The K/V this request has computed is really there, untouched by anyone else.
            assert self._read(table, r.num_computed_tokens) == r.token_ids_slice(0, r.num_computed_tokens)
        for rid, r in self.all.items():
            if r.is_finished:
                assert rid not in sched.requests and rid not in kv.req_to_blocks
                assert r not in sched.waiting and r not in sched.running
            assert r.num_output_tokens <= r.sampling_params.max_tokens
        # Every published prefix-cache entry holds the tokens its hash chain was made from.
        for block_hash, block_id in kv.pool._cached.items():
            assert kv.pool.blocks[block_id].block_hash == block_hash
        assert sched.num_preemptions == sum(r.num_preemptions for r in self.all.values())


# ---- the state machine ---------------------------------------------------------------------------


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    # Small pools half the time: memory pressure (preemption, eviction) needs few blocks.
    num_blocks = draw(st.one_of(st.integers(4, 12), st.integers(4, 64)), label="num_blocks")
    cap = min(num_blocks * block_size, 48)
    # Often as long as the cache allows, so a few requests fill it.
    max_model_len = draw(st.one_of(st.just(cap), st.integers(max(1, cap // 2), cap), st.integers(1, cap)),
                         label="max_model_len")
    max_num_seqs = draw(st.integers(1, 8), label="max_num_seqs")
    chunked = draw(st.booleans(), label="chunked")
    lo = max_num_seqs if chunked else max(max_num_seqs, max_model_len)
    max_num_batched_tokens = draw(st.integers(lo, lo + 24), label="max_num_batched_tokens")
    caching = draw(st.booleans(), label="caching")
    return Cfg(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, chunked, caching)


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
    @rule(data=st.data())
    def step_with_mid_step_abort(self, data):
        rid = data.draw(st.sampled_from(sorted(r.request_id for r in self.h.sched.running)), label="mid")
        self.h.step(abort_mid_step=rid)

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
    max_examples=200,
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
    sched.update(out, {"x": 1})
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    new = Request("x", [0, 1, 2, 3, 0], Params(1))
    sched.add_request(new)  # the id is free again once the old request finished
    out = sched.schedule()
    # The runner hears about the old "x" finishing before it sees the new "x" as a new request.
    assert out.finished_req_ids == ["x"]
    (s,) = out.scheduled
    assert s.is_new and s.request_id == "x" and s.start_pos == 2  # one cached block of the old "x"
    assert s.token_ids == [2, 3, 0]
    sched.update(out, {"x": 0})
    assert new.is_finished and old.num_output_tokens == 1 and new.num_output_tokens == 1
    h.kv.check_invariants()
    assert h.kv.pool.num_free_blocks == cfg.num_blocks
