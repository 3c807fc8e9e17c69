"""The batched torch attention (the CPU path) against the per-request reference it optimizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.ops.torch_attention import TorchAttentionBackend, reference_attention
from tests.paged_batch import make_batch

# GQA with 3 query heads per KV head, and blocks small enough that contexts span several.
SHAPE = {"num_heads": 6, "num_kv_heads": 2, "head_dim": 16, "block_size": 4}


def assert_same_as_reference(ctx_lens, q_lens, backend=None, **kw):
    q, k, v, cache, meta = make_batch(ctx_lens, q_lens, **{**SHAPE, **kw})
    ref_cache, fast_cache = cache.clone(), cache.clone()
    ref = reference_attention(q, k, v, ref_cache, meta, 0.25)
    out = (backend or TorchAttentionBackend()).forward(q, k, v, fast_cache, meta, 0.25)
    torch.testing.assert_close(fast_cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ctx_lens,q_lens", [
    ([5, 0, 17, 3], [1, 1, 1, 1]),  # decode only, unequal contexts (padded keys)
    ([8, 8], [1, 1]),  # decode only, equal contexts (no mask)
    ([0, 0, 0], [7, 7, 7]),  # fresh prompts of one length: one batched causal call
    ([0, 0, 0, 0], [7, 3, 3, 9]),  # fresh prompts of several lengths
    ([6, 0, 0, 11, 0], [1, 5, 5, 4, 2]),  # mixed: decodes, fresh prompts, chunks after cached context
    ([9], [6]),  # one chunk after context (chunked prefill / prefix hit)
])
def test_batched_equals_reference(ctx_lens, q_lens):
    assert_same_as_reference(ctx_lens, q_lens)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=6), st.integers(0, 1000))
def test_batched_equals_reference_on_random_batches(reqs, seed):
    assert_same_as_reference([c for c, _ in reqs], [n for _, n in reqs], seed=seed)


def test_plan_is_rebuilt_for_each_step():
    """One backend serves every step: a new step's metadata must not reuse the last step's plan."""
    backend = TorchAttentionBackend()
    assert_same_as_reference([0, 0], [5, 5], backend=backend)
    assert_same_as_reference([5, 9, 2], [1, 1, 1], backend=backend)
    assert_same_as_reference([3, 0], [1, 4], backend=backend)
