"""Triton dequantize-GEMM for packed int4/int8 weights (the served layout of int_weights.py).

One kernel, two launch shapes:
* prefill (many rows): tiles of BLOCK_M x BLOCK_N, the whole K per program;
* decode (few rows): weight-read bound, so the N tiles alone leave SMs idle; K is split SPLIT_K ways
  into fp32 partials, summed afterwards (deterministic, unlike atomics). Each program still reads
  each packed int32 once per its BLOCK_K rows: int4 reads 1/4 of bf16's weight bytes.
Weights are dequantized in registers ((q - z) * s in fp32, then to the activation dtype) and fed to
tl.dot, so W is never materialized in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.model.quantization.triton_int_groups import group_scales_zeros, tile_group_scales_zeros
from kvserve.ops import split_k as splits


@triton.jit
def _int_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, stride_os, k_per_split,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr, ONE_GROUP_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # Each packed int32 is read once: [BLOCK_K / PACK, BLOCK_N] words, unpacked by broadcasting the
        # shifts to [BLOCK_K / PACK, PACK, BLOCK_N] and flattening to rows k = word * PACK + field.
        offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
        w_ok = (offs_w < tl.cdiv(k_end, PACK))[:, None] & n_ok[None, :]
        packed = tl.load(qw_ptr + offs_w[:, None].to(tl.int64) * N + offs_n[None, :], mask=w_ok, other=0)
        shifts = tl.arange(0, PACK) * BITS
        q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & MASK, [BLOCK_K, BLOCK_N])
        if ONE_GROUP_PER_TILE:  # the tile's rows share one group: one row of scales and zeros
            s, z = tile_group_scales_zeros(s_ptr, z_ptr, k0, offs_n, n_ok, N, GROUP_SIZE)
        else:
            s, z = group_scales_zeros(s_ptr, z_ptr, g_ptr, offs_k, k_ok, offs_n, k_ok[:, None] & n_ok[None, :], N,
                                      GROUP_SIZE, HAS_G_IDX)
        w = ((q.to(tl.float32) - z) * s).to(x.dtype)
        acc += tl.dot(x, w, input_precision=DOT_PREC)
    out_off = pid_k.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
PREFILL_CONFIG = (64, 128, 32, 4, 3)
DECODE_CONFIG = (16, 64, 128, 4, 3)
DECODE_MAX_ROWS = 16


def int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             g_idx: torch.Tensor | None, bits: int, group_size: int, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(qweight) [K, N] -> [M, N] in x's dtype. split_k None: chosen by M."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    decode = m <= DECODE_MAX_ROWS
    block_m, block_n, block_k, warps, stages = DECODE_CONFIG if decode else PREFILL_CONFIG
    if split_k is None:
        # Enough programs for about two per SM; each split keeps at least 4 K tiles.
        tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
        split_k = max(1, min(triton.cdiv(2 * splits.num_sms(x.device), tiles), k // (4 * block_k))) if decode else 1
    # Splits and tiles start at multiples of BLOCK_K (itself a multiple of the pack factor).
    split_k, k_per_split = splits.split_in_tiles(k, split_k, block_k)
    out, stride_os = splits.partials(m, n, split_k, x.dtype, x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    dummy = qweight  # g_idx pointer when there is none (never read)
    _int_gemm_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else dummy, out,
        m, n, k, x.stride(0), n, stride_os, k_per_split,
        BITS=bits, GROUP_SIZE=group_size, HAS_G_IDX=g_idx is not None,
        ONE_GROUP_PER_TILE=g_idx is None and group_size % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )
    return splits.finish(out, split_k, x.dtype)
