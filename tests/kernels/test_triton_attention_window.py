"""The Triton kernels' per-layer options against the dense definition and the torch backend: a sliding
window, whose blocks left of every window are poisoned with NaN (freed blocks must never be read), and
logit soft-capping. On CPU tensors under Triton's interpreter (tests/kernels/test_triton_interpreter.py runs this
file so) and compiled on CUDA (the gpu tier, `pytest -m gpu`), where bf16 at Gemma-3-12B's head shapes
is checked too."""

from __future__ import annotations

import pytest
import torch

from tests import paged_batch
from tests.triton_interpreter import KERNEL_DEVICE, KERNEL_TIER, compiled_only

pytest.importorskip("triton")

import kvserve.ops.triton_attention as ta
from kvserve.ops.torch_attention import TorchAttentionBackend

pytestmark = KERNEL_TIER
DEVICE = KERNEL_DEVICE


def check(ctx_lens, q_lens, window, soft_cap=None, backend=None, dtype=torch.float32, atol=1e-4,
          poison_unwritten=False, **kw):
    q, k, v, cache, meta = paged_batch.make_batch(ctx_lens, q_lens, device=DEVICE, **kw)
    q, k, v, cache = (x.to(dtype) for x in (q, k, v, cache))
    scale = q.shape[-1] ** -0.5
    expected = paged_batch.dense_attention(q, k, v, cache, meta, scale, ctx_lens, window, soft_cap)
    if window is not None:
        paged_batch.poison_outside_window(cache, meta, ctx_lens, window)
    if poison_unwritten:
        paged_batch.poison_past_sequence_ends(cache, meta)
    tri_cache = cache.clone()
    out = (backend or ta.TritonAttentionBackend()).forward(q, k, v, tri_cache, meta, scale, sliding_window=window,
                                                           logits_soft_cap=soft_cap)
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=atol)
    if dtype == torch.float32:
        ref = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, scale, sliding_window=window,
                                              logits_soft_cap=soft_cap)
        torch.testing.assert_close(out, ref, atol=atol, rtol=atol)


MIXED = ([21, 5, 0, 47, 70], [19, 1, 6, 1, 30])  # chunk after context, decodes, a fresh prompt


@pytest.mark.parametrize("window", [1, 5, 16, 33, 200])
def test_window_mixed(window):
    check(*MIXED, window, block_size=4, seed=window)


@pytest.mark.parametrize("window", [3, 40])
def test_window_small_tiles(window):
    # 16-row tiles and 16-key steps: masked low part, unmasked middle and masked causal end all occur.
    backend = ta.TritonAttentionBackend(split_kv=False)
    backend.PREFILL_CONFIG = backend.DECODE_CONFIG = (16, 16, 4, 1)
    check([37, 0, 3, 64, 100], [22, 40, 1, 1, 33], window, backend=backend, num_heads=8, num_kv_heads=2,
          block_size=4, seed=12)


@pytest.mark.parametrize("window", [2, 7, 64])
def test_window_decode_unified(window):
    check([0, 6, 8, 16, 29, 70, 300], [1] * 7, window, backend=ta.TritonAttentionBackend(split_kv=False), seed=window)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("window", [3, 50])
def test_window_decode_split_kv(window, num_splits):
    check([0, 6, 29, 70, 300], [1] * 5, window, backend=ta.TritonAttentionBackend(split_kv=True, num_splits=num_splits),
          num_heads=8, num_kv_heads=2, seed=num_splits)


@pytest.mark.parametrize("window", [None, 9])
def test_soft_cap(window):
    check(*MIXED, window, soft_cap=0.7, block_size=8, seed=3)
    check([6, 29, 300], [1, 1, 1], window, soft_cap=0.7, backend=ta.TritonAttentionBackend(split_kv=True, num_splits=3))


def test_non_power_of_two_group_with_window():
    check([9, 0, 30], [1, 25, 3], 6, num_heads=6, num_kv_heads=2, block_size=8, seed=5)


@compiled_only
@pytest.mark.parametrize("soft_cap", [None, 50.0])
@pytest.mark.parametrize("block_size", [16, 64])
def test_gemma_shapes_bf16(soft_cap, block_size):
    # Gemma-3-12B-like heads (16 q / 8 kv, head_dim 256), a 1024-token window over longer contexts; a long prefill
    # (the TMA path on Hopper with 64-token blocks), with NaN in the slots past each sequence's end.
    ctx, ql = [0, 3000, 5000, 1500, 900], [2048, 1, 1, 300, 1]
    for window in (1024, None):
        check(ctx, ql, window, soft_cap, dtype=torch.bfloat16, atol=2e-2, num_heads=16, num_kv_heads=8,
              head_dim=256, block_size=block_size, seed=21, poison_unwritten=True)


@compiled_only
@pytest.mark.parametrize("window", [1024, None])
@pytest.mark.parametrize("long_context_split", [None, 1024])
def test_gemma_decode_batch_bf16(window, long_context_split):
    """A decode-only batch of Gemma-3-12B-like heads (head_dim 256: the wide-head decode configurations), over
    contexts longer than the window; with long_context_split the full batch still takes the split-KV path."""
    backend = ta.TritonAttentionBackend()
    backend.WIDE_HEAD_LONG_CONTEXT_KEYS_PER_SPLIT = long_context_split
    ctx = [3000, 5000, 1500, 900, 4200, 2600, 6100, 1100] * 3
    splits = backend.choose_num_splits(len(ctx), 8, 1, max(ctx) + 1, head_dim=256)
    assert (splits > 1) == (long_context_split is not None)
    check(ctx, [1] * len(ctx), window, dtype=torch.bfloat16, atol=2e-2, num_heads=16, num_kv_heads=8,
          head_dim=256, block_size=16, seed=22, backend=backend)


def test_window_long_prefill_step_one_launch(monkeypatch):
    # A windowed layer keeps a long prefill step's decodes in the unified kernel (their programs walk no more
    # keys than the chunk's).
    spy = paged_batch.CountLaunches(ta._decode_kernel)
    monkeypatch.setattr(ta, "_decode_kernel", spy)
    check([70, 5, 0, 130], [1, 33, 1, 1], 24, backend=paged_batch.long_prefill_backend(), num_heads=8,
          num_kv_heads=2, block_size=8, seed=2)
    assert spy.launches == 0


@pytest.mark.parametrize("window", [None, 1, 5, 24])
def test_tma_kv_tiles(monkeypatch, window):
    """Long prefill steps on a cache whose block size is a multiple of the key step load each K/V tile with one TMA
    copy: the same output as the dense definition, with NaN in every block left of the windows and in each
    sequence's unwritten slots (a tile may cover them: they must not reach the output). Under the interpreter the
    TMA gate is forced open (fp16: its bf16 dot is unusable)."""
    if DEVICE == "cpu":
        monkeypatch.setattr(ta, "tma_supported", lambda device: True)
    backend = paged_batch.long_prefill_backend()
    backend.TMA_KV = True
    backend.LONG_PREFILL_CONFIG = backend.WIDE_HEAD_LONG_PREFILL_CONFIG = (32, 16, 4, 2)
    spy = paged_batch.CountLaunches(ta._unified_attention_kernel)
    monkeypatch.setattr(ta, "_unified_attention_kernel", spy)
    check([0, 40, 7, 30, 3], [37, 20, 1, 45, 1], window, backend=backend, dtype=torch.float16, atol=2e-3,
          num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, seed=31, poison_unwritten=True)
    assert spy.kwargs["KV_TMA"]
