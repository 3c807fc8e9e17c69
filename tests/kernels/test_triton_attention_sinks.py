"""Attention sinks (gpt-oss) in the Triton kernels against the dense definition and the torch backend:
the unified kernel (prefill chunks, fresh prompts, decodes; with a window, whose left-out blocks are
poisoned), the split-KV decode (the sink added when the splits are combined) and the one-split decode.
On CPU tensors under Triton's interpreter (tests/kernels/test_triton_interpreter.py runs this file so)
and compiled on CUDA (the gpu tier, `pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from tests import paged_batch
from tests.triton_interpreter import KERNEL_DEVICE, KERNEL_TIER

pytest.importorskip("triton")

import kvserve.ops.triton_attention as ta
from kvserve.ops.torch_attention import TorchAttentionBackend

pytestmark = KERNEL_TIER
DEVICE = KERNEL_DEVICE
HEADS, KV_HEADS = 8, 2


def check(ctx_lens, q_lens, window=None, backend=None, seed=0, **kw):
    q, k, v, cache, meta = paged_batch.make_batch(ctx_lens, q_lens, device=DEVICE, num_heads=HEADS,
                                                  num_kv_heads=KV_HEADS, seed=seed, **kw)
    # Some sinks far above the scores (they take most of the attention), some far below (nearly none).
    sinks = (torch.linspace(-6.0, 9.0, HEADS) + 0.1 * seed).to(DEVICE)
    scale = q.shape[-1] ** -0.5
    expected = paged_batch.dense_attention(q, k, v, cache, meta, scale, ctx_lens, window, sinks=sinks)
    if window is not None:
        paged_batch.poison_outside_window(cache, meta, ctx_lens, window)
    out = (backend or ta.TritonAttentionBackend()).forward(q, k, v, cache.clone(), meta, scale,
                                                           sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out.float().cpu(), expected, atol=1e-4, rtol=1e-4)
    ref = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, scale, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    plain = paged_batch.dense_attention(q, k, v, cache, meta, scale, ctx_lens, window)
    assert not torch.allclose(out.float().cpu(), plain, atol=1e-2)  # the sinks took their share


MIXED = ([21, 5, 0, 47, 70], [19, 1, 6, 1, 30])  # chunk after context, decodes, a fresh prompt


@pytest.mark.parametrize("window", [None, 5, 33])
def test_sinks_mixed(window):
    check(*MIXED, window, block_size=4, seed=3)


@pytest.mark.parametrize("window", [None, 7])
def test_sinks_decode_unified(window):
    check([0, 6, 8, 29, 70, 300], [1] * 6, window, backend=ta.TritonAttentionBackend(split_kv=False), seed=1)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 50])
def test_sinks_decode_split_kv(window, num_splits):
    check([0, 6, 29, 70, 300], [1] * 5, window,
          backend=ta.TritonAttentionBackend(split_kv=True, num_splits=num_splits), seed=num_splits)


def test_sinks_must_be_one_float32_logit_per_head():
    q, k, v, cache, meta = paged_batch.make_batch([3], [2], device=DEVICE, num_heads=HEADS, num_kv_heads=KV_HEADS)
    with pytest.raises(ValueError, match="one logit per query head"):
        ta.TritonAttentionBackend().forward(q, k, v, cache, meta, 0.1, sinks=torch.zeros(KV_HEADS, device=DEVICE))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sinks_long_prefill_step_decodes(num_splits):
    # The sink of a long prefill step's decodes (a layer without a window): added by the decode kernel (one split)
    # or the combine kernel.
    check([70, 5, 0, 130], [1, 33, 1, 1], None, backend=paged_batch.long_prefill_backend(num_splits), block_size=8,
          seed=num_splits)
