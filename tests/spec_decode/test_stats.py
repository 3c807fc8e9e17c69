"""Acceptance counts: what vLLM's spec_decode metrics and the log line are made of."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvserve.spec_decode.stats import SpecDecodeStats


def test_counts_and_acceptance_length():
    s = SpecDecodeStats()
    for drafts, accepted in [(3, 3), (3, 1), (0, 0), (2, 0)]:
        s.observe(drafts, accepted)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 4)
    assert s.accepted_per_pos == [2, 1, 1]
    assert s.mean_acceptance_length == 1 + 4 / 3
    assert "mean acceptance length 2.33" in s.log_text() and "per position 0.67, 0.33, 0.33" in s.log_text()
    assert SpecDecodeStats().mean_acceptance_length is None


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=30), st.integers(0, 30))
def test_merging_intervals_equals_one_interval(results, cut):
    results = [(d, min(a, d)) for d, a in results]
    whole, first, second = SpecDecodeStats(), SpecDecodeStats(), SpecDecodeStats()
    for i, r in enumerate(results):
        whole.observe(*r)
        (first if i < cut else second).observe(*r)
    first.merge(second)
    assert first == whole
    assert sum(whole.accepted_per_pos) == whole.num_accepted_tokens
