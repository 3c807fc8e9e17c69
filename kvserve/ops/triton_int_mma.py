"""Tensor-core GEMM for packed int4/int8 weights at a few dozen to a few hundred rows (the served layout of
kvserve/model/quantization/int_weights.py): x [M, K] @ W [K, N], W never written to memory.

Each program computes an output tile transposed, out^T [BLOCK_N, BLOCK_M] = W^T [BLOCK_N, BLOCK_K] @
x^T [BLOCK_K, BLOCK_M]: the weight, unpacked and dequantized in registers, is the MMA's left operand (which
Hopper's wgmma may take from registers) and the activations are the right one, read from memory as they
are. At 17-256 rows the weights' N is the large dimension, so it takes the MMA's M side (a multiple of 64),
and the rows take its N side (any multiple of 8).

Unpacking: the [BLOCK_N, BLOCK_K / PACK] tile of packed words is read once; its PACK bit fields are joined
along a new last axis (tl.join, in-thread) and reshaped to [BLOCK_N, BLOCK_K], so column w * PACK + p is
field p of word w, i.e. input row k0 + w * PACK + p, the packing order. Dequantizing is the same fp32
arithmetic as IntWeights.dequantize ((q - z) * s, q - z exact by the 2**23 trick of triton_int_gemv.py),
rounded once to the activation dtype: the product is that of the dequantized reference weight.

Few output tiles (N = 4096 at 32 rows: 32 tiles for 132 SMs) leave SMs idle: K is then split, in one
launch (split_k_atomic.py). Launches depend on shapes only: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.ops.split_k import num_sms, split_in_tiles
from kvserve.ops.split_k_atomic import store_tile, workspace


@triton.jit
def _unpack(packed, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 [BLOCK_N, BLOCK_K / PACK] -> int32 [BLOCK_N, BLOCK_K], column w * PACK + p = field p of word w."""
    MASK: tl.constexpr = (1 << BITS) - 1
    f0 = packed & MASK
    f1 = (packed >> BITS) & MASK
    f2 = (packed >> (2 * BITS)) & MASK
    f3 = (packed >> (3 * BITS)) & MASK
    if BITS == 4:
        f4 = (packed >> 16) & MASK
        f5 = (packed >> 20) & MASK
        f6 = (packed >> 24) & MASK
        f7 = (packed >> 28) & MASK
        # Each join appends an axis, the last join the innermost: index (i, j, l) holds field 4 i + 2 j + l.
        q = tl.join(tl.join(tl.join(f0, f4), tl.join(f2, f6)), tl.join(tl.join(f1, f5), tl.join(f3, f7)))
    else:  # 8 bits: index (i, l) holds field 2 i + l
        q = tl.join(tl.join(f0, f2), tl.join(f1, f3))
    return tl.reshape(q, [BLOCK_N, BLOCK_K])


@triton.jit
def _mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_om, k_per_split, split_k,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr, ONE_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    PACK: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // PACK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_w = k0 // PACK + tl.arange(0, KW)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = qw_ptr + offs_w[None, :].to(tl.int64) * N + offs_n[:, None]
        if EVEN_K:  # whole K tiles: masks only on the edges along N and M, constant along K
            packed = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            xt = tl.load(x_cols + offs_k[:, None], mask=m_ok[None, :], other=0.0)
        else:
            w_ok = offs_w < k_end // PACK  # K, k_per_split: multiples of PACK
            packed = tl.load(w_ptrs, mask=n_ok[:, None] & w_ok[None, :], other=0)
            xt = tl.load(x_cols + offs_k[:, None], mask=m_ok[None, :] & (offs_k < k_end)[:, None], other=0.0)
        if ONE_GROUP:  # BLOCK_K divides GROUP_SIZE and tiles start at multiples of BLOCK_K: one group per tile
            g_off = (k0 // GROUP_SIZE) * N + offs_n
            s = tl.load(s_ptr + g_off, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            zm = tl.load(z_ptr + g_off, mask=n_ok, other=0.0).to(tl.float32)[:, None] + 8388608.0
        else:
            if HAS_G_IDX:
                group = tl.load(g_ptr + offs_k, mask=offs_k < k_end, other=0)
            else:
                group = offs_k // GROUP_SIZE
            g_off = group[None, :].to(tl.int64) * N + offs_n[:, None]
            g_ok = n_ok[:, None] & (offs_k < k_end)[None, :]  # no group past the last row: w is 0 there
            s = tl.load(s_ptr + g_off, mask=g_ok, other=0.0).to(tl.float32)
            zm = tl.load(z_ptr + g_off, mask=g_ok, other=0.0).to(tl.float32) + 8388608.0
        q = _unpack(packed, BITS, BLOCK_N, BLOCK_K)
        qf = (q | 0x4B000000).to(tl.float32, bitcast=True)
        wt = ((qf - zm) * s).to(xt.dtype)
        acc = tl.dot(wt, xt, acc, input_precision=DOT_PREC)
    out_ok = n_ok[:, None] & m_ok[None, :]
    out_off = offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tile = pid_m * tl.num_programs(0) + pid_n
    store_tile(acc, out_ptr, out_off, ws_ptr, offs_m[None, :] * N + offs_n[:, None], out_ok, cnt_ptr, tile,
               split_k, SPLIT)


# Split-K: about PROGRAMS_PER_SM programs in all per SM when the output tiles alone are fewer, each split
# still at least MIN_K_TILES tiles of K.
PROGRAMS_PER_SM = 2
MIN_K_TILES = 4


def mma_split_k(m: int, n: int, k: int, device: torch.device, config: tuple[int, int, int, int, int]) -> int:
    block_n, block_m, block_k = config[:3]
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    sms = num_sms(device)
    if tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, tiles), k // (MIN_K_TILES * block_k)))


def mma_int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor | None, bits: int, group_size: int,
                 config: tuple[int, int, int, int, int], split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(qweight) [K, N] -> [M, N] in x's dtype. config: (BLOCK_N, BLOCK_M, BLOCK_K,
    num_warps, num_stages); split_k: programs per output tile along K (None: mma_split_k's choice)."""
    assert x.dim() == 2 and bits in (4, 8), (x.shape, bits)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    block_n, block_m, block_k, warps, stages = config
    if split_k is None:
        split_k = mma_split_k(m, n, k, x.device, config)
    split_k, k_per_split = split_in_tiles(k, split_k, block_k)
    tiles_n, tiles_m = triton.cdiv(n, block_n), triton.cdiv(m, block_m)
    ws = workspace(x.device, m * n, tiles_n * tiles_m) if split_k > 1 else None
    if split_k > 1 and ws is None:
        split_k, k_per_split = 1, k
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dummy = qweight  # pointers that are never read
    _mma_kernel[(tiles_n, split_k, tiles_m)](
        x, qweight, scales, zeros, g_idx if g_idx is not None else dummy, out,
        ws[0] if ws else dummy, ws[1] if ws else dummy,
        m, n, k, x.stride(0), out.stride(0), k_per_split, split_k,
        BITS=bits, GROUP_SIZE=group_size, HAS_G_IDX=g_idx is not None,
        ONE_GROUP=g_idx is None and group_size % block_k == 0,
        BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, EVEN_K=k % block_k == 0 and k_per_split % block_k == 0,
        SPLIT=split_k > 1, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )
    return out
