"""The draft budget: drafts only where the cost model says they pay (batch size, verify overhead, acceptance,
share of requests with a draft), none at large batches, and rare probes that let it recover."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.spec_decode.draft_budget import BudgetChoice, DraftBudget
from kvserve.spec_decode.drafter import Drafter
from kvserve.speculative_config import parse_speculative_config


def _budget_with(acceptance: list[float], hit_rate: float = 1.0, **kw) -> DraftBudget:
    b = DraftBudget(len(acceptance), **kw)
    b.acceptance = list(acceptance)
    b.hit_rate = hit_rate
    return b


def _cuda_budget(acceptance: list[float], hit_rate: float = 1.0) -> DraftBudget:
    """The budget the engine builds for n-gram drafts on a GPU."""
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": len(acceptance)})
    b = Drafter(spec, "cuda").budget
    b.acceptance, b.hit_rate = list(acceptance), hit_rate
    return b


@settings(max_examples=200, deadline=None)
@given(acceptance=st.lists(st.floats(0, 1), min_size=1, max_size=8), sat=st.integers(1, 512),
       draft_cost=st.floats(0, 0.5), overhead=st.floats(1, 2), hit_rate=st.floats(0, 1),
       batches=st.lists(st.integers(1, 1024), min_size=2, max_size=6))
def test_fewer_drafts_as_the_batch_grows(acceptance, sat, draft_cost, overhead, hit_rate, batches):
    b = _budget_with(acceptance, hit_rate, saturation_tokens=sat, draft_step_cost=draft_cost,
                     verify_overhead=overhead, probe_interval=10 ** 9)
    ks = [b.choose(n).num_draft_tokens for n in sorted(batches)]
    assert all(0 <= k <= len(acceptance) for k in ks)
    assert ks == sorted(ks, reverse=True)


def test_perfect_drafts_at_batch_one_use_every_position():
    assert _budget_with([1.0] * 5).choose(1).num_draft_tokens == 5
    assert _cuda_budget([1.0] * 5).choose(1).num_draft_tokens == 5


def test_past_saturation_speculation_is_off_whatever_the_acceptance():
    b = _budget_with([1.0] * 4, saturation_tokens=128)
    choice = b.choose(256)
    assert (choice.num_draft_tokens, choice.reason) == (0, "batch size")
    # Near saturation only short drafts pay: 48 requests x (1 + k) crosses 128 tokens at k = 2.
    assert _budget_with([0.9] * 4, saturation_tokens=128).choose(48).num_draft_tokens <= 2


@pytest.mark.parametrize("batch", [100, 128, 256, 512])
def test_on_a_gpu_large_batches_never_draft_even_with_perfect_drafts(batch):
    # A verify step costs 1.3x a decode step before saturation: with 2B tokens past 128 the best a right
    # draft can do (2 tokens for 1.3 * 2B / max(128, B) the cost) no longer pays.
    choice = _cuda_budget([1.0] * 4).choose(batch)
    assert (choice.num_draft_tokens, choice.reason) == (0, "batch size")


def test_verify_overhead_needs_more_accepted_tokens_than_it_costs():
    # Batch 16 on a GPU: 16 (1 + k) tokens stay under saturation for every k here, so a drafting step costs the
    # overhead, 1.3 + 15 x 0.015 = 1.525x. Drafts found for half the requests and right 40% of the time give at
    # most 1.33 tokens per step: a loss.
    assert _cuda_budget([0.4] * 4, hit_rate=0.5).choose(16) == BudgetChoice(0, "acceptance")
    # Found for every request and right 90% of the time: 4.1 tokens for 1.525x at k = 4.
    assert _cuda_budget([0.9] * 4).choose(16) == BudgetChoice(4, "on")
    # Without the overhead the first case would look like a gain.
    assert _budget_with([0.4] * 4, hit_rate=0.5, saturation_tokens=128, min_gain=1.05).choose(16).num_draft_tokens > 0


def test_the_exposed_host_work_of_a_large_batch_rules_drafts_out():
    # Batch 64 on a GPU: a synchronous verify step costs 1.3 + 63 x 0.015 = 2.25x the asynchronous decode step
    # (the H200 measured 2.24x), so not even drafts that are always right can pay; at batch 1 the per-request
    # term adds nothing.
    b = _cuda_budget([1.0] * 4)
    assert b.relative_cost(64, 1, 1.0) == pytest.approx(2.245)
    assert b.choose(64) == BudgetChoice(0, "batch size")
    assert b.relative_cost(1, 4, 1.0) == pytest.approx(1.3)
    assert b.choose(1) == BudgetChoice(4, "on")


def test_a_proposer_that_finds_no_drafts_turns_speculation_off():
    b = _cuda_budget([1.0] * 4)
    for _ in range(10):
        b.record_proposals(64, 0)
    assert b.hit_rate < 0.01
    assert b.choose(1) == BudgetChoice(0, "acceptance")  # every draft it finds would be right, but it finds none


def test_a_draft_that_costs_what_it_saves_is_turned_down_for_its_cost():
    # An oracle draft as large as the target: each draft is right, and costs a whole target forward.
    b = _budget_with([1.0] * 4, draft_step_cost=1.0)
    assert b.choose(1) == BudgetChoice(0, "draft cost")
    assert _budget_with([0.8] * 4, draft_step_cost=0.1).choose(1).num_draft_tokens >= 2
    assert _budget_with([1.0] * 4, saturation_tokens=128, draft_step_cost=1.0).choose(256).reason == "batch size"


def test_a_costly_draft_that_pays_only_with_long_drafts_is_not_turned_down():
    # One draft at cost 0.95: 2 tokens for 1.95 (< 1.03 gain); four: 5 tokens for 4.8 (1.04).
    b = _budget_with([1.0] * 4, draft_step_cost=0.95)
    assert b.would_draft(1)
    assert b.choose(1) == BudgetChoice(4, "on")


def test_low_acceptance_turns_off_and_probes_ever_more_rarely():
    b = _budget_with([0.01] * 3, probe_interval=4, max_probe_interval=16)
    choices = [b.choose(1) for _ in range(60)]
    probes = [i + 1 for i, c in enumerate(choices) if c.reason == "probe"]
    assert probes == [4, 12, 28, 44, 60]  # waits of 4, 8, 16, then 16 at most
    assert all(c.num_draft_tokens == 1 for c in choices if c.reason == "probe")
    assert {c.reason for c in choices} == {"acceptance", "probe"}


def test_probes_that_are_accepted_bring_speculation_back_and_reset_the_wait():
    b = _budget_with([0.01] * 3, probe_interval=4, max_probe_interval=64)
    for _ in range(40):
        b.choose(1)
    for _ in range(200):  # the probes now get accepted: the estimate climbs and speculation comes back
        b.record(1, 1)
    assert b.choose(1).reason == "on"
    b.acceptance = [0.01] * 3
    assert [b.choose(1).reason for _ in range(4)] == ["acceptance"] * 3 + ["probe"]


def test_a_large_batch_does_not_count_towards_the_next_probe():
    b = _budget_with([0.01] * 3, saturation_tokens=8, probe_interval=4)
    assert [b.choose(64).reason for _ in range(10)] == ["batch size"] * 10
    assert [b.choose(1).reason for _ in range(4)] == ["acceptance"] * 3 + ["probe"]


@settings(max_examples=100, deadline=None)
@given(results=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=50),
       proposals=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), max_size=20))
def test_estimates_stay_probabilities_and_follow_what_was_tried(results, proposals):
    b = DraftBudget(6)
    for drafts, accepted in results:
        accepted = min(accepted, drafts)
        before = list(b.acceptance)
        b.record(drafts, accepted)
        assert all(0 <= a <= 1 for a in b.acceptance)
        for j, (old, new) in enumerate(zip(before, b.acceptance)):
            if j < accepted:
                assert new >= old  # accepted positions move up
            elif j == accepted and j < drafts:
                assert new <= old  # the first rejected one moves down
            else:
                assert new == old  # positions never tried are left alone
    for offered, found in proposals:
        found = min(found, offered)
        before = b.hit_rate
        b.record_proposals(offered, found)
        assert 0 <= b.hit_rate <= 1
        if offered:  # moves towards this call's share, never past it
            share = found / offered
            assert min(before, share) - 1e-12 <= b.hit_rate <= max(before, share) + 1e-12


def test_bad_measurements_are_refused():
    b = DraftBudget(2)
    with pytest.raises(ValueError):
        b.record(3, 1)
    with pytest.raises(ValueError):
        b.record_proposals(2, 3)
    with pytest.raises(ValueError):
        DraftBudget(2, verify_overhead=0.9)


def test_a_probe_asks_about_a_few_decoding_requests_and_counts_what_was_found():
    from types import SimpleNamespace

    from kvserve.spec_decode import drafter as drafter_module

    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2})
    d = Drafter(spec, "cuda")
    asked = []

    class Half:  # finds a draft for every other request it is asked about
        def propose(self, requests, num_tokens=None):
            asked.append([r.request_id for r in requests])
            return {r.request_id: [1] for r in requests[::2]}
    d.proposer = Half()
    requests = [SimpleNamespace(request_id=str(i), output_token_ids=[] if i < 3 else [5]) for i in range(30)]
    d.last_choice = BudgetChoice(1, "probe")
    assert len(d.propose(requests)) == drafter_module.PROBE_REQUESTS // 2
    assert asked[-1] == [str(i) for i in range(3, 3 + drafter_module.PROBE_REQUESTS)]  # prefilling ones left out
    d.last_choice = BudgetChoice(2, "on")
    d.propose(requests)
    assert asked[-1] == [str(i) for i in range(3, 30)]
    assert d.budget.hit_rate < 1.0
    d.last_choice = BudgetChoice(0, "acceptance")
    assert d.propose(requests) == {} and len(asked) == 2  # off: the proposer is not asked
