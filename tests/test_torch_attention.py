"""The batched torch attention (the CPU path) against the per-request reference it optimizes."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.ops.attention_metadata import AttentionMetadata
from kvserve.ops.torch_attention import TorchAttentionBackend, reference_attention


def make_step(ctx_lens, q_lens, *, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, seed=0):
    """One step's q/k/v and metadata over a random paged cache (shuffled blocks, garbage in unused slots)."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    ids = list(range(1, num_blocks))
    rnd.shuffle(ids)
    tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    for i, nb in enumerate(blocks):
        tables[i, :nb] = torch.tensor([ids.pop() for _ in range(nb)], dtype=torch.int32)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size
             for i, (c, s) in enumerate(zip(ctx_lens, seq_lens)) for p in range(c, s)]
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=qsl, seq_lens=seq_t,
        block_tables=tables, max_query_len=max(q_lens), max_seq_len=max(seq_lens), num_actual_tokens=len(slots),
        block_size=block_size, query_start_loc_cpu=qsl.clone(), seq_lens_cpu=seq_t.clone(),
    )
    t = len(slots)
    q = torch.randn(t, num_heads, head_dim, generator=g)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    return q, k, v, cache, meta


def assert_same_as_reference(ctx_lens, q_lens, backend=None, **kw):
    q, k, v, cache, meta = make_step(ctx_lens, q_lens, **kw)
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
