"""The Triton attention backend against the torch reference (fp32): on CPU tensors under Triton's
interpreter (tests/kernels/test_triton_interpreter.py runs this file so) and compiled on CUDA tensors (the gpu
tier, `pytest -m gpu`): see tests/triton_interpreter.py."""

from __future__ import annotations

import pytest
import torch

from tests import paged_batch
from tests.triton_interpreter import KERNEL_DEVICE, KERNEL_TIER, compiled_only

pytest.importorskip("triton")

import kvserve.ops.triton_attention as ta
from kvserve.ops.attention_metadata import AttentionMetadata
from kvserve.ops.torch_attention import TorchAttentionBackend

pytestmark = KERNEL_TIER
ATOL = 1e-4
RTOL = 1e-4
DEVICE = KERNEL_DEVICE


def make_batch(ctx_lens, q_lens, **kw):
    return paged_batch.make_batch(ctx_lens, q_lens, device=DEVICE, **kw)


def run_both(q, k, v, kv_cache, meta, backend=None):
    """(triton out, triton cache, reference out, reference cache). The reference gets the slot mapping
    trimmed to the real tokens (torch indexing would write slot -1 into the cache's last slot)."""
    scale = q.shape[-1] ** -0.5
    n = meta.num_actual_tokens
    ref_meta = AttentionMetadata(**{**meta.__dict__, "slot_mapping": meta.slot_mapping[:n]})
    ref_cache = kv_cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, ref_meta, scale)
    tri_cache = kv_cache.clone()
    out = (backend or ta.TritonAttentionBackend()).forward(q, k, v, tri_cache, meta, scale)
    return out, tri_cache, ref, ref_cache


def check(ctx_lens, q_lens, backend=None, **kw):
    q, k, v, kv_cache, meta = make_batch(ctx_lens, q_lens, **kw)
    out, tri_cache, ref, ref_cache = run_both(q, k, v, kv_cache, meta, backend)
    n = meta.num_actual_tokens
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(tri_cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out[:n], ref[:n], atol=ATOL, rtol=RTOL)
    return out, ref


# --- decode-only -------------------------------------------------------------------------------------

DECODE_CTX = [0, 6, 8, 16, 29, 70, 300]  # contexts before the step: 1..301 keys, multiples of 8 and not


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_decode_unified(num_heads, num_kv_heads):
    check(DECODE_CTX, [1] * len(DECODE_CTX), ta.TritonAttentionBackend(split_kv=False),
          num_heads=num_heads, num_kv_heads=num_kv_heads, seed=num_heads + num_kv_heads)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_decode_split_kv(num_splits, num_heads, num_kv_heads):
    # 5 splits of a 1-token context: all but the first split are empty.
    check(DECODE_CTX, [1] * len(DECODE_CTX), ta.TritonAttentionBackend(split_kv=True, num_splits=num_splits),
          num_heads=num_heads, num_kv_heads=num_kv_heads, seed=num_splits)


def test_decode_split_kv_heuristic_path():
    # A few long decodes on a pretend 8-SM GPU: the default backend takes the split path by itself.
    backend = ta.TritonAttentionBackend(num_sms=8)
    assert backend.choose_num_splits(2, 2, 1, 600) > 1
    check([599, 300], [1, 1], backend, block_size=16, seed=3)


@pytest.mark.parametrize("meta_splits,expect_split", [(3, True), (1, False), (None, False)])
def test_meta_num_kv_splits_decides(monkeypatch, meta_splits, expect_split):
    # The model runner fixes the split count in the metadata (graph replays and eager steps alike);
    # it overrides the backend's own choice for decode-only batches.
    spy = paged_batch.CountLaunches(ta._decode_kernel)
    monkeypatch.setattr(ta, "_decode_kernel", spy)
    q, k, v, kv_cache, meta = make_batch([40, 9], [1, 1], seed=14)
    meta.num_kv_splits = meta_splits
    out, tri_cache, ref, ref_cache = run_both(q, k, v, kv_cache, meta, ta.TritonAttentionBackend(split_kv=False))
    torch.testing.assert_close(tri_cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    assert spy.launches == int(expect_split)


def test_choose_num_splits():
    b = ta.TritonAttentionBackend(num_sms=132)
    assert b.choose_num_splits(4, 8, 1, 2048) == 8  # 32 programs, 2048 keys: 8 splits of 256 keys
    assert b.choose_num_splits(256, 8, 1, 2048) == 1  # the grid already fills the GPU
    assert b.choose_num_splits(4, 8, 1, 300) == 1  # too short to be worth it
    assert b.choose_num_splits(4, 8, 2, 4096) == 1  # not decode-only
    assert 1 < b.choose_num_splits(1, 1, 1, 1 << 20) <= b.MAX_SPLITS
    assert ta.TritonAttentionBackend(split_kv=False).choose_num_splits(1, 1, 1, 4096) == 1
    assert ta.TritonAttentionBackend(split_kv=True).choose_num_splits(1, 1, 1, 40) == 2
    assert ta.TritonAttentionBackend(split_kv=True, num_splits=7).choose_num_splits(1, 1, 1, 40) == 7
    assert ta.TritonAttentionBackend(split_kv=True, num_splits=7).choose_num_splits(1, 1, 3, 40) == 1
    long = ta.TritonAttentionBackend(num_sms=132)
    long.LONG_CONTEXT_KEYS_PER_SPLIT = 4096
    assert long.choose_num_splits(64, 8, 1, 16384) == 4  # a full grid of long contexts: splits of ~4096 keys
    assert long.choose_num_splits(64, 8, 1, 8191) == 1  # shorter than two such splits
    assert long.choose_num_splits(64, 8, 1, 1 << 20) == long.MAX_SPLITS
    assert long.choose_num_splits(64, 8, 2, 16384) == 1  # not decode-only
    wide = ta.TritonAttentionBackend(num_sms=132)  # the defaults: heads wider than 128 split long contexts
    assert wide.choose_num_splits(64, 8, 1, 16384, head_dim=256) == 16384 // wide.WIDE_HEAD_LONG_CONTEXT_KEYS_PER_SPLIT
    assert wide.choose_num_splits(64, 8, 1, 16384, head_dim=128) == 1


# --- prefill and mixed -------------------------------------------------------------------------------

@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_prefill(num_heads, num_kv_heads):
    # 40 tokens span several q tiles for every GQA ratio (64 rows / group size).
    check([0, 0, 0], [40, 1, 7], num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=16, seed=11)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch(num_heads, num_kv_heads, block_size):
    # A prefill chunk on top of a cached prefix (chunked prefill / prefix hit), decodes, a fresh prompt.
    check([21, 5, 0, 47], [19, 1, 6, 1], num_heads=num_heads, num_kv_heads=num_kv_heads,
          block_size=block_size, seed=block_size + num_heads)


def test_non_power_of_two_group():
    # Qwen2-0.5B style GQA group of 7 (here 3): 64 // 3 tokens per tile, unused rows masked.
    check([9, 0, 30], [1, 25, 3], num_heads=6, num_kv_heads=2, block_size=8, seed=5)
    check([9, 30], [1, 1], ta.TritonAttentionBackend(split_kv=True, num_splits=2), num_heads=6, num_kv_heads=2)


def test_small_tiles():
    # 16-row tiles (4 tokens x a group of 4) and 16-key steps: many q tiles per request, many KV steps,
    # unmasked and masked ones, on 4-slot blocks.
    backend = ta.TritonAttentionBackend(split_kv=False)
    backend.PREFILL_CONFIG = backend.DECODE_CONFIG = (16, 16, 4, 1)
    check([37, 0, 3, 64], [22, 9, 1, 1], backend, num_heads=8, num_kv_heads=2, block_size=4, seed=12)
    check([37, 64], [1, 1], backend, num_heads=8, num_kv_heads=2, block_size=4, seed=13)


def test_request_lookup():
    # Eleven requests: tiles of short and long queries, decodes, empty tile slots in between; each program finds
    # its request by binary search over the query start locations.
    backend = ta.TritonAttentionBackend(split_kv=False)
    backend.PREFILL_CONFIG = (16, 16, 4, 1)
    check([3, 0, 40, 7, 0, 12, 30, 0, 5, 9, 2], [1, 9, 17, 1, 2, 33, 1, 4, 1, 1, 20], backend, num_heads=4,
          num_kv_heads=2, block_size=8, seed=14)


@pytest.mark.parametrize("q_scale", [3.0, 30.0, 300.0])
def test_online_softmax_as_row_maxima_grow(q_scale):
    # Large scores whose running row maxima grow from one 16-key step to the next by small and by large
    # steps (x300: jumps past fp32's range unless the max moves): the online softmax gives the reference, on
    # decodes, a prefill chunk on cached keys and the split-KV path.
    for split in (False, True):
        backend = ta.TritonAttentionBackend(split_kv=split, num_splits=3 if split else None)
        backend.PREFILL_CONFIG = backend.DECODE_CONFIG = backend.SPLIT_CONFIG = (16, 16, 4, 1)
        ctx, q_lens = ([70, 0, 33], [1, 40, 9]) if not split else ([70, 33], [1, 1])
        q, k, v, kv_cache, meta = make_batch(ctx, q_lens, num_heads=4, num_kv_heads=2, block_size=8,
                                             seed=int(q_scale) + split)
        out, _, ref, _ = run_both(q * q_scale, k, v, kv_cache, meta, backend)
        n = meta.num_actual_tokens
        torch.testing.assert_close(out[:n], ref[:n], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_head_dims(head_dim):
    check([12, 0], [5, 9], num_heads=2, num_kv_heads=1, head_dim=head_dim, block_size=32, seed=head_dim)


def test_strided_qkv_views():
    # q, k, v as views of a fused projection: token stride (H + 2 Hkv) * D.
    check([10, 3], [6, 1], qkv_views=True, seed=7)
    check([10, 3], [1, 1], ta.TritonAttentionBackend(split_kv=True, num_splits=2), qkv_views=True, seed=8)


# --- CUDA-graph padding ------------------------------------------------------------------------------

@pytest.mark.parametrize("pad_slots", [False, True])
def test_padding_tokens_not_written(pad_slots):
    # T = real tokens + 5 padding tokens; slot_mapping either stops at num_actual_tokens or holds -1 there.
    q, k, v, kv_cache, meta = make_batch([13, 2], [4, 1], pad_tokens=5, pad_slots=pad_slots, seed=9)
    assert meta.num_actual_tokens + 5 == q.shape[0]
    assert meta.slot_mapping.shape[0] == (q.shape[0] if pad_slots else meta.num_actual_tokens)
    out, tri_cache, ref, ref_cache = run_both(q, k, v, kv_cache, meta)
    n = meta.num_actual_tokens
    torch.testing.assert_close(tri_cache, ref_cache, atol=0, rtol=0)  # only the real tokens' slots changed
    torch.testing.assert_close(out[:n], ref[:n], atol=ATOL, rtol=RTOL)


def test_negative_slot_skipped_and_num_actual_tokens_respected():
    _, k, v, kv_cache, meta = make_batch([4], [6], seed=10)
    before = kv_cache.clone()
    meta.slot_mapping = meta.slot_mapping.clone()
    skipped = int(meta.slot_mapping[2])
    meta.slot_mapping[2] = -1
    ta.reshape_and_cache(k, v, kv_cache, meta.slot_mapping, num_tokens=5)  # token 5 is past the limit
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    flat_before = before.view(2, -1, *kv_cache.shape[3:])
    for t in range(6):
        slot = int(meta.slot_mapping[t]) if t != 2 else skipped
        if t in (2, 5):
            torch.testing.assert_close(flat[:, slot], flat_before[:, slot], atol=0, rtol=0)
        else:
            torch.testing.assert_close(flat[0, slot], k[t], atol=0, rtol=0)
            torch.testing.assert_close(flat[1, slot], v[t], atol=0, rtol=0)
    last = flat.shape[1] - 1
    if last not in meta.slot_mapping.tolist():  # -1 did not wrap around to the cache's last slot
        assert torch.equal(flat[:, last], flat_before[:, last])


def test_get_attention_backend():
    from kvserve.ops.attention_backend import get_attention_backend

    assert type(get_attention_backend("triton")).__name__ == "TritonAttentionBackend"



# --- 16-bit activations and caches, as served ---------------------------------------------------------

HALF_CASES = [  # (context lengths, query lengths, forced split-KV): prefill, mixed, decode, split-KV decode
    ([0, 0], [40, 7], None),
    ([21, 5, 0, 47], [19, 1, 6, 1], None),
    ([0, 6, 29, 300], [1, 1, 1, 1], False),
    ([599, 300], [1, 1], True),
]


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=compiled_only)],
                         ids=["fp16", "bf16"])
@pytest.mark.parametrize("ctx_lens,q_lens,split", HALF_CASES, ids=["prefill", "mixed", "decode", "split-kv"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_16bit_kv_cache(dtype, ctx_lens, q_lens, split, head_dim):
    """q/k/v and the cache in the served dtype against the fp32 reference over the same (rounded) values:
    the cache holds the exact k/v bytes; the output is off by the 16-bit rounding of P and of the result."""
    q, k, v, kv_cache, meta = make_batch(ctx_lens, q_lens, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                                         block_size=16, seed=head_dim + len(ctx_lens))
    q, k, v, kv_cache = (x.to(dtype) for x in (q, k, v, kv_cache))
    backend = ta.TritonAttentionBackend(split_kv=split, num_splits=3 if split else None)
    n = meta.num_actual_tokens
    ref_cache = kv_cache.float()
    ref_meta = AttentionMetadata(**{**meta.__dict__, "slot_mapping": meta.slot_mapping[:n]})
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), ref_cache, ref_meta, head_dim ** -0.5)
    tri_cache = kv_cache.clone()
    out = backend.forward(q, k, v, tri_cache, meta, head_dim ** -0.5)
    assert out.dtype == dtype
    assert torch.equal(tri_cache, ref_cache.to(dtype))
    tol = 5e-3 if dtype == torch.float16 else 3e-2
    torch.testing.assert_close(out[:n].float(), ref[:n], atol=tol, rtol=tol)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (32, 8)])
def test_long_prefill_config(num_heads, num_kv_heads):
    """Steps with a long query take LONG_PREFILL_CONFIG (bigger tiles); here the threshold is lowered so a
    40-token prompt and a chunk on a cached prefix take it, against the reference."""
    backend = ta.TritonAttentionBackend()
    assert backend.launch_config(1) == backend.DECODE_CONFIG
    assert backend.launch_config(backend.LONG_PREFILL_MIN_QUERY - 1) == backend.PREFILL_CONFIG
    assert backend.launch_config(backend.LONG_PREFILL_MIN_QUERY) == backend.LONG_PREFILL_CONFIG
    assert backend.launch_config(backend.LONG_PREFILL_MIN_QUERY, 256) == backend.WIDE_HEAD_LONG_PREFILL_CONFIG
    assert backend.launch_config(backend.LONG_PREFILL_MIN_QUERY, 128, query_bytes=4) == backend.PREFILL_CONFIG
    backend.LONG_PREFILL_MIN_QUERY = 32
    check([0, 77, 5], [40, 33, 1], backend, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
          block_size=16, seed=num_heads)


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("mixed_kernel", [True, False])
def test_long_prefill_step_decodes_by_decode_kernel(monkeypatch, num_splits, mixed_kernel):
    """A long prefill step's one-token queries go to the decode kernel (with or without splits), the rest to the
    unified kernel, which skips them: the same output as one unified launch, the reference's."""
    spy = paged_batch.CountLaunches(ta._decode_kernel)
    monkeypatch.setattr(ta, "_decode_kernel", spy)
    backend = paged_batch.long_prefill_backend(num_splits)
    backend.MIXED_STEP_DECODE_KERNEL = mixed_kernel
    check([70, 5, 0, 130, 0], [1, 33, 1, 1, 20], backend, num_heads=8, num_kv_heads=2, block_size=16, seed=21)
    assert spy.launches == int(mixed_kernel)
    spy.launches = 0
    check([4, 9], [40, 20], backend, num_heads=8, num_kv_heads=2, block_size=16, seed=22)  # no decodes
    short = paged_batch.long_prefill_backend(num_splits)
    check([70, 5], [1, 15], short, num_heads=8, num_kv_heads=2, block_size=16, seed=23)  # no long query
    assert spy.launches == 0
