"""Weight-streaming FP8 decode GEMM, W8A16: y = x @ (w_e4m3 * scale[:, None])^T for M <= 16 rows, in one
launch per call.

Decode reads every weight byte once and does little else, so the kernel's job is to keep HBM busy:
* M == 1: no tensor cores. Each program streams [BLOCK_N, BLOCK_K] slabs of the weight (contiguous along
  K, as stored: 16-byte loads), converts them to fp32 in registers and multiplies by x's slice into a
  [BLOCK_N, BLOCK_K] fp32 accumulator, reduced over K once after the loop.
* 2 <= M <= 16: tl.dot with the weight slab as the left operand (out^T [BLOCK_N, 16] = W [BLOCK_N, BLOCK_K]
  @ x^T [BLOCK_K, 16]): the weight's N takes the MMA's large side, the few rows its small one, and the
  slab goes from registers to the tensor cores.
The per-output-channel scale multiplies the fp32 sum once (per-tensor checkpoint scales are expanded to
per-channel at load, fp8.py). Activations stay unquantized: at least as accurate as W8A8.

N = 4096 in tiles of 16-64 columns leaves SMs idle, so K is split over several programs per tile whose
partials meet in one launch (split_k_atomic.py): no reduction or cast kernel after it, which at 128 decode
GEMMs a step is most of the gain over a partials-then-sum split. Launches depend on shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.ops.split_k import num_sms, split_in_tiles
from kvserve.ops.split_k_atomic import store_tile, workspace


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_om, k_per_split, split_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        if EVEN_K:  # whole K tiles: masks only on the edges along N and M, constant along K
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M == 1:
            if EVEN_K:
                x = tl.load(x_ptr + offs_k)
            else:
                x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        else:
            if EVEN_K:
                xt = tl.load(x_cols + offs_k[:, None], mask=m_ok[None, :], other=0.0)
            else:
                xt = tl.load(x_cols + offs_k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(w.to(xt.dtype), xt, acc, input_precision=DOT_PREC)
    scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
    if BLOCK_M == 1:
        part = (tl.sum(acc, axis=1) * scale)[:, None]
    else:
        part = acc * scale[:, None]
    out_ok = n_ok[:, None] & m_ok[None, :]
    out_off = offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    store_tile(part, out_ptr, out_off, ws_ptr, offs_m[None, :] * N + offs_n[:, None], out_ok, cnt_ptr, pid_n,
               split_k, SPLIT)


MAX_ROWS = 16
# Split-K: about PROGRAMS_PER_SM programs in all per SM, each split at least MIN_K_TILES tiles of K.
PROGRAMS_PER_SM = 4
MIN_K_TILES = 2


def fp8_gemv_split_k(n: int, k: int, device: torch.device, config: tuple[int, int, int, int]) -> int:
    block_n, block_k = config[:2]
    tiles = triton.cdiv(n, block_n)
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms(device), tiles)
    return max(1, min(want, k // (MIN_K_TILES * block_k)))


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: tuple[int, int, int, int],
             split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16; 16/32-bit float), weight e4m3 [N, K], scale float32 [N] -> [M, N] in x's dtype.
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages); split_k None: fp8_gemv_split_k's choice."""
    assert x.dim() == 2 and weight.shape[1] == x.shape[1] and weight.stride(1) == 1
    m, k = x.shape
    assert m <= MAX_ROWS, m
    x = x if x.stride(-1) == 1 else x.contiguous()
    n = weight.shape[0]
    block_n, block_k, warps, stages = config
    if split_k is None:
        split_k = fp8_gemv_split_k(n, k, x.device, config)
    split_k, k_per_split = split_in_tiles(k, split_k, block_k)
    tiles = triton.cdiv(n, block_n)
    ws = workspace(x.device, m * n, tiles) if split_k > 1 else None
    if split_k > 1 and ws is None:
        split_k, k_per_split = 1, k
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dummy = out  # pointers that are never read
    _fp8_gemv_kernel[(tiles, split_k)](
        x, weight, scale, out, ws[0] if ws else dummy, ws[1] if ws else dummy,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split, split_k,
        BLOCK_M=1 if m == 1 else 16, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0 and k_per_split % block_k == 0, SPLIT=split_k > 1,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
    )
    return out
