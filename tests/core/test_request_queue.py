"""The waiting queue: O(1) removal (aborts are linear), turns across groups, resumed requests first."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.request_queue import RequestQueue
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.sampling_params import SamplingParams


class CountingRequest(Request):
    """Counts equality tests: a queue that scans for a request calls __eq__ on every other one it passes."""

    comparisons = 0

    def __eq__(self, other):
        CountingRequest.comparisons += 1
        return self is other

    __hash__ = object.__hash__


def _req(rid: str, group: str | None = None, cls=Request) -> Request:
    return cls(rid, [1, 2, 3], SamplingParams(max_tokens=4), group_id=group)


def _scheduler(num_blocks: int = 64, max_num_seqs: int = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=1024, max_model_len=64),
                     KVCacheManager(num_blocks, 16, True))


@pytest.mark.parametrize("num_waiting", [3_000, 100_000])
def test_aborting_every_waiting_request_is_linear(num_waiting):
    sched = _scheduler()
    reqs = [_req(f"r{i}", group=f"api{i % 7}", cls=CountingRequest) for i in range(num_waiting)]
    for r in reqs:
        sched.add_request(r)
    CountingRequest.comparisons = 0
    sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
    # A scan per abort would compare ~num_waiting**2 / 2 times (4.5 million for 3,000 requests).
    assert CountingRequest.comparisons <= num_waiting
    assert not sched.waiting and not sched.requests and len(sched.waiting) == 0
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in reqs)


def test_aborting_running_requests_filters_the_running_list_once():
    sched = _scheduler(max_num_seqs=8)
    reqs = [_req(f"r{i}", cls=CountingRequest) for i in range(20)]
    for r in reqs:
        sched.add_request(r)
    sched.schedule()
    assert len(sched.running) == 8
    CountingRequest.comparisons = 0
    sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
    assert CountingRequest.comparisons <= len(reqs)
    assert not sched.running and not sched.waiting and sched.kv.usage() == 0


def test_one_api_requests_fan_out_does_not_starve_another():
    """A big request's 1,000 sequences are queued first; a later single-sequence request is admitted in the
    first step that has room, not after the 1,000."""
    sched = _scheduler(num_blocks=4096, max_num_seqs=4)
    for i in range(1000):
        sched.add_request(_req(f"big-{i}", group="big"))
    small = _req("small", group="small")
    sched.add_request(small)
    out = sched.schedule()
    assert "small" in [s.request_id for s in out.scheduled]
    assert [s.request_id for s in out.scheduled] == ["big-0", "small", "big-1", "big-2"]


def test_resumed_requests_go_first_most_recent_first():
    q = RequestQueue()
    a, b, c, d = (_req(x, group="g") for x in "abcd")
    q.append(a)
    q.append(b)
    q.appendleft(c)
    q.appendleft(d)
    assert list(q) == [d, c, a, b] and q.peek() is d and q[-1] is b
    assert [q.popleft() for _ in range(4)] == [d, c, a, b] and not q


def test_remove_refuses_a_request_that_is_not_queued():
    q = RequestQueue()
    a = _req("a")
    q.append(a)
    with pytest.raises(ValueError, match="not in the waiting queue"):
        q.remove(_req("a"))  # same id, another object
    assert a in q and len(q) == 1


class _Reference:
    """The queue's order, the slow obvious way."""

    def __init__(self):
        self.front, self.groups = [], {}  # groups: insertion-ordered dict = rotation

    def append(self, r):
        self.groups.setdefault(r.fairness_group, []).append(r)

    def appendleft(self, r):
        self.front.insert(0, r)

    def popleft(self):
        if self.front:
            return self.front.pop(0)
        g = next(iter(self.groups))
        r = self.groups[g].pop(0)
        rest = self.groups.pop(g)
        if rest:
            self.groups[g] = rest
        return r

    def remove(self, r):
        if any(x is r for x in self.front):
            self.front = [x for x in self.front if x is not r]
            return
        g = r.fairness_group
        self.groups[g] = [x for x in self.groups[g] if x is not r]
        if not self.groups[g]:
            del self.groups[g]

    def order(self):
        out, saved = list(self.front), {g: list(m) for g, m in self.groups.items()}
        while saved:
            for g in list(saved):
                out.append(saved[g].pop(0))
                if not saved[g]:
                    del saved[g]
        return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "appendleft", "popleft", "remove"]),
                          st.integers(0, 3), st.integers(0, 50)), max_size=60))
def test_queue_matches_the_reference_order(ops):
    q, ref, queued, n = RequestQueue(), _Reference(), [], 0
    for op, group, pick in ops:
        if op in ("append", "appendleft"):
            r = _req(f"r{n}", group=f"g{group}")
            n += 1
            getattr(q, op)(r)
            getattr(ref, op)(r)
            queued.append(r)
        elif op == "popleft" and queued:
            r = q.popleft()
            assert r is ref.popleft()
            queued.remove(r)
        elif op == "remove" and queued:
            r = queued.pop(pick % len(queued))
            q.remove(r)
            ref.remove(r)
        assert list(q) == ref.order() and len(q) == len(queued)
        assert all(r in q for r in queued)
