"""Per-layer attention options of the torch backend: a sliding window (key j visible from query i iff
i - window < j <= i, keys left of every window never read) and logit soft-capping, against a dense
definition written from positions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.ops.torch_attention import TorchAttentionBackend, reference_attention
from tests.paged_batch import dense_attention, make_batch, poison_outside_window

SHAPE = {"num_heads": 6, "num_kv_heads": 2, "head_dim": 16, "block_size": 4}
SCALE = 0.25


def check(ctx_lens, q_lens, window, soft_cap=None, seed=0):
    q, k, v, cache, meta = make_batch(ctx_lens, q_lens, seed=seed, **SHAPE)
    expected = dense_attention(q, k, v, cache, meta, SCALE, ctx_lens, window, soft_cap)
    if window is not None:
        poison_outside_window(cache, meta, ctx_lens, window)
    ref = reference_attention(q, k, v, cache.clone(), meta, SCALE, sliding_window=window, logits_soft_cap=soft_cap)
    fast = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, SCALE, sliding_window=window,
                                           logits_soft_cap=soft_cap)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 5, 8, 64])
@pytest.mark.parametrize("ctx_lens,q_lens", [
    ([5, 0, 17, 3], [1, 1, 1, 1]),  # decode only, contexts shorter and longer than the window
    ([0, 0, 0], [7, 7, 7]),  # fresh prompts of one length
    ([0, 0, 0, 0], [7, 3, 3, 9]),
    ([6, 0, 0, 11, 0], [1, 5, 5, 4, 2]),  # mixed
    ([9], [6]),  # a chunk after context
])
def test_window_matches_definition(ctx_lens, q_lens, window):
    check(ctx_lens, q_lens, window)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("ctx_lens,q_lens", [([5, 0, 17, 3], [1, 1, 1, 1]), ([6, 0, 0, 11, 0], [1, 5, 5, 4, 2])])
def test_soft_cap_matches_definition(ctx_lens, q_lens, window):
    check(ctx_lens, q_lens, window, soft_cap=1.5)


def test_no_window_equals_window_longer_than_context():
    check([6, 0, 11], [1, 5, 4], None)
    check([6, 0, 11], [1, 5, 4], 100)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=6), st.integers(1, 12),
       st.booleans(), st.integers(0, 1000))
def test_window_on_random_batches(reqs, window, capped, seed):
    check([c for c, _ in reqs], [n for _, n in reqs], window, 2.0 if capped else None, seed=seed)


def test_one_backend_serves_layers_of_different_windows():
    """Interleaved layers reuse one backend within a step: each window gets its own plan."""
    backend = TorchAttentionBackend()
    ctx, ql = [6, 0, 13], [1, 5, 3]
    q, k, v, cache, meta = make_batch(ctx, ql, **SHAPE)
    for window in (3, None, 3, None):
        out = backend.forward(q, k, v, cache.clone(), meta, SCALE, sliding_window=window)
        torch.testing.assert_close(out, dense_attention(q, k, v, cache, meta, SCALE, ctx, window), atol=1e-5, rtol=1e-5)
