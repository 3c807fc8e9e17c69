"""Split-K skinny GEMM (decode, M <= 16) for packed int4/int8 weights (the served layout of
kvserve/model/quantization/int_weights.py).

Decode is weight-read bound: the kernel reads each packed int32 word exactly once, dequantizes it in
registers with its group's scale and zero, and accumulates in fp32. N / BLOCK_N column tiles alone leave
most of the 132 SMs idle at N = 4096, so K is split over `split_k` programs per tile as well.

* M == 1 (BLOCK_M == 1): no tensor cores; a [BLOCK_K / PACK, BLOCK_N] fp32 accumulator takes one FMA
  per weight, reduced over K once after the loop.
* 2 <= M <= 16: tl.dot of x [16, BLOCK_K / PACK] with each field's dequantized rows.
Fields are handled one at a time (field p of every word = rows word * PACK + p), so unpacking is a
shift and a mask in the packed tile's own layout, and x is read at the matching strided rows. The int
to float conversion uses the 2**23 trick: the bits of q | 0x4B000000 are the float 2**23 + q, so
q - z is one subtraction of (z + 2**23), exact.

Split-K partials meet in one launch (split_k_atomic.py): CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.ops.triton_int_groups import group_scales_zeros, tile_group_scales_zeros
from kvserve.ops.split_k import split_in_tiles
from kvserve.ops.split_k_atomic import store_tile, workspace


@triton.jit
def _skinny_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_om, k_per_split, split_k,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr, ONE_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    KW: tl.constexpr = BLOCK_K // PACK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    if BLOCK_M == 1:
        acc = tl.zeros([KW, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_w = k0 // PACK + tl.arange(0, KW)
        w_ok = offs_w < k_end // PACK  # K, k_per_split: multiples of PACK
        tile_ok = w_ok[:, None] & n_ok[None, :]
        packed = tl.load(qw_ptr + offs_w[:, None].to(tl.int64) * N + offs_n[None, :], mask=tile_ok, other=0)
        if ONE_GROUP:  # BLOCK_K divides GROUP_SIZE and tiles start at multiples of BLOCK_K
            s_tile, z_tile = tile_group_scales_zeros(s_ptr, z_ptr, k0, offs_n, n_ok, N, GROUP_SIZE)
            zm_tile = z_tile + 8388608.0
        for p in tl.static_range(PACK):
            rows = offs_w * PACK + p
            if ONE_GROUP:
                s = s_tile
                zm = zm_tile
            else:
                s, z = group_scales_zeros(s_ptr, z_ptr, g_ptr, rows, w_ok, offs_n, tile_ok, N, GROUP_SIZE, HAS_G_IDX)
                zm = z + 8388608.0
            qf = (((packed >> (p * BITS)) & MASK) | 0x4B000000).to(tl.float32, bitcast=True)
            w = (qf - zm) * s  # rows past k_end: x is 0 there
            if BLOCK_M == 1:
                x = tl.load(x_ptr + rows, mask=w_ok, other=0.0).to(tl.float32)
                acc += x[:, None] * w
            else:
                x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + rows[None, :],
                            mask=m_ok[:, None] & w_ok[None, :], other=0.0)
                acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PREC)
    if BLOCK_M == 1:
        part = tl.sum(acc, axis=0)[None, :]
    else:
        part = acc
    out_ok = m_ok[:, None] & n_ok[None, :]
    out_off = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    store_tile(part, out_ptr, out_off, ws_ptr, offs_m[:, None] * N + offs_n[None, :], out_ok, cnt_ptr, pid_n,
               split_k, SPLIT)


MAX_ROWS = 16
def skinny_int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    g_idx: torch.Tensor | None, bits: int, group_size: int, split_k: int,
                    config: tuple[int, int, int, int]) -> torch.Tensor:
    """x [M, K] (M <= 16) @ dequant(qweight) [K, N] -> [M, N] in x's dtype. config: (BLOCK_N, BLOCK_K,
    num_warps, num_stages); split_k: programs per column tile along K (rounded to whole BLOCK_K tiles)."""
    m, k = x.shape
    assert m <= MAX_ROWS, m
    x = x if x.stride(-1) == 1 else x.contiguous()
    n = qweight.shape[1]
    block_n, block_k, warps, stages = config
    split_k, k_per_split = split_in_tiles(k, split_k, block_k)
    tiles = triton.cdiv(n, block_n)
    ws = workspace(x.device, m * n, tiles) if split_k > 1 else None
    if split_k > 1 and ws is None:
        k_per_split, split_k = k, 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    dummy = qweight  # pointers that are never read
    _skinny_kernel[(tiles, split_k)](
        x, qweight, scales, zeros, g_idx if g_idx is not None else dummy, out,
        ws[0] if ws else dummy, ws[1] if ws else dummy,
        m, n, k, x.stride(0), out.stride(0), k_per_split, split_k,
        BITS=bits, GROUP_SIZE=group_size, HAS_G_IDX=g_idx is not None,
        ONE_GROUP=g_idx is None and group_size % block_k == 0,
        BLOCK_M=1 if m == 1 else 16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split_k > 1,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )
    return out
