"""Attention sinks (gpt-oss) in the torch backend: a learned logit per head joins each softmax's
denominator. Both torch paths (the reference and the batched backend) against the dense definition, with
and without a window, for decodes, fresh prompts and chunks after context."""

from __future__ import annotations

import pytest
import torch

from kvserve.ops.torch_attention import TorchAttentionBackend, reference_attention
from tests.paged_batch import dense_attention, make_batch, poison_outside_window

SHAPE = {"num_heads": 6, "num_kv_heads": 2, "head_dim": 16, "block_size": 4}
SCALE = 0.25


def _sinks(heads: int, seed: int) -> torch.Tensor:
    # Large enough that the sink takes a real share of some rows (and nearly all of one head's).
    return torch.tensor([3.0, -1.0, 0.5, 8.0, -4.0, 1.5][:heads]) + 0.1 * seed


@pytest.mark.parametrize("window", [None, 3, 8])
@pytest.mark.parametrize("ctx_lens,q_lens", [
    ([5, 0, 17, 3], [1, 1, 1, 1]),  # decode only
    ([0, 0, 0], [7, 7, 7]),  # fresh prompts of one length
    ([6, 0, 0, 11, 0], [1, 5, 5, 4, 2]),  # mixed
    ([9], [6]),  # a chunk after context
])
def test_sinks_match_definition(ctx_lens, q_lens, window):
    q, k, v, cache, meta = make_batch(ctx_lens, q_lens, seed=len(ctx_lens), **SHAPE)
    sinks = _sinks(SHAPE["num_heads"], len(q_lens))
    expected = dense_attention(q, k, v, cache, meta, SCALE, ctx_lens, window, sinks=sinks)
    if window is not None:
        poison_outside_window(cache, meta, ctx_lens, window)
    ref = reference_attention(q, k, v, cache.clone(), meta, SCALE, sliding_window=window, sinks=sinks)
    fast = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, SCALE, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)
    # The sinks change the result (the oracle is not the plain softmax).
    plain = dense_attention(q, k, v, cache, meta, SCALE, ctx_lens, window)
    assert not torch.allclose(fast, plain, atol=1e-3)
