"""The draft budget: full drafts when they pay, none at large batches or low acceptance, probes to recover."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.spec_decode.draft_budget import BudgetChoice, DraftBudget


def _budget_with(acceptance: list[float], **kw) -> DraftBudget:
    b = DraftBudget(len(acceptance), **kw)
    b.acceptance = list(acceptance)
    return b


@settings(max_examples=200, deadline=None)
@given(acceptance=st.lists(st.floats(0, 1), min_size=1, max_size=8), sat=st.integers(1, 512),
       draft_cost=st.floats(0, 0.5), batches=st.lists(st.integers(1, 1024), min_size=2, max_size=6))
def test_fewer_drafts_as_the_batch_grows(acceptance, sat, draft_cost, batches):
    b = _budget_with(acceptance, saturation_tokens=sat, draft_step_cost=draft_cost, probe_interval=10 ** 9)
    ks = [b.choose(n).num_draft_tokens for n in sorted(batches)]
    assert all(0 <= k <= len(acceptance) for k in ks)
    assert ks == sorted(ks, reverse=True)


def test_perfect_drafts_at_batch_one_use_every_position():
    assert _budget_with([1.0] * 5).choose(1).num_draft_tokens == 5


def test_past_saturation_speculation_is_off_whatever_the_acceptance():
    b = _budget_with([1.0] * 4, saturation_tokens=128)
    choice = b.choose(256)
    assert (choice.num_draft_tokens, choice.reason) == (0, "batch size")
    # Near saturation only short drafts pay: 48 requests x (1 + k) crosses 128 tokens at k = 2.
    assert _budget_with([0.9] * 4, saturation_tokens=128).choose(48).num_draft_tokens <= 2


def test_a_draft_that_costs_what_it_saves_is_turned_down_for_its_cost():
    # An oracle draft as large as the target: each draft is right, and costs a whole target forward.
    b = _budget_with([1.0] * 4, draft_step_cost=1.0)
    assert b.choose(1) == BudgetChoice(0, "draft cost")
    assert _budget_with([0.8] * 4, draft_step_cost=0.1).choose(1).num_draft_tokens >= 2
    assert _budget_with([1.0] * 4, saturation_tokens=128, draft_step_cost=1.0).choose(256).reason == "batch size"


def test_low_acceptance_turns_off_and_probes_to_recover():
    b = _budget_with([0.01] * 3, probe_interval=4)
    reasons = [b.choose(1) for _ in range(8)]
    assert [c.num_draft_tokens for c in reasons] == [0, 0, 0, 1, 0, 0, 0, 1]
    assert {c.reason for c in reasons} == {"acceptance", "probe"}
    for _ in range(200):  # the probes now get accepted: the estimate climbs and speculation comes back
        b.record(1, 1)
    assert b.choose(1).num_draft_tokens >= 1


@settings(max_examples=100, deadline=None)
@given(results=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=50))
def test_estimates_stay_probabilities_and_follow_what_was_tried(results):
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
