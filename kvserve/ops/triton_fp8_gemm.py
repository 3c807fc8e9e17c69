"""Weight-streaming FP8 GEMM for few rows (decode): W8A16, y = x @ (w_e4m3 * scale[:, None])^T, or with
group scales along K (block-wise FP8 checkpoints: scale [R, ceil(K / GROUP_K)] and the scale row r[n] of each
output row) y = x @ (w_e4m3 * scale[r[n], k // GROUP_K])^T.

At a handful of rows a linear layer is bound by reading its weight; the FP8 weight is half of bf16's
bytes. torch._scaled_mm would first need the activations quantized (another kernel) and its row-wise
kernels are tuned for large M. Here each program reads a [BLOCK_N, BLOCK_K] slab of the e4m3 weight
(contiguous along K, as stored), converts it to the activation dtype in registers and feeds tl.dot with
the (unquantized) activation rows; the per-output-channel scale is applied once to the fp32 accumulator.
Group scales are applied to the weight tile instead, in fp32, before it is rounded to the activation dtype: the
product is that of the dequantized weight.
Activations are not quantized, so this path is at least as accurate as W8A8.

Few output tiles (small N) leave SMs idle: K is then split into fp32 partials summed afterwards
(deterministic). The launch depends only on shapes, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvserve.ops import split_k as splits


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, r_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om, stride_os, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr, GROUP_K: tl.constexpr,
):
    """GROUP_K 0: per-channel scales s [N]; else s [R, ceil(K / GROUP_K)] (row stride stride_sn), row r[n]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GROUP_K:
        s_rows = tl.load(r_ptr + offs_n, mask=n_ok, other=0).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:  # every tile whole along K: masks only on the row/column edges (constant along K)
            x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < k_end
            x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if GROUP_K:
            s = tl.load(s_ptr + s_rows[:, None] * stride_sn + (offs_k // GROUP_K)[None, :],
                        mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            w = w.to(tl.float32) * s
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PREC)
    if not GROUP_K:
        scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * scale[None, :]
    out_off = pid_k.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_M follows the rows, 16 (tl.dot's minimum) to 64.
# Measured on the H200 (benchmarks/sweep_fp8_linear.py, 7 configs x W1's 4 shapes x M 1 and 16): this one
# was best or within 5% of the best everywhere; the first guess (16, 512, 4, 4) was 1.2-1.8x slower.
CONFIG = (32, 256, 4, 4)

# What a program may use when there is no GPU to ask (the interpreter on CPU): an H100/H200's opt-in
# shared memory per block, 227 KiB.
DEFAULT_SHARED_MEMORY = 232448


@functools.cache
def _cuda_shared_memory(index: int) -> int:
    # The limit Triton itself checks a compiled kernel's shared memory against at launch.
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def shared_memory_limit(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_shared_memory(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_SHARED_MEMORY


def shared_memory_bytes(block_m: int, block_n: int, block_k: int, stages: int, x_bytes: int) -> int:
    """One program's shared memory as Triton lays _w8a16_kernel out: num_stages - 1 pipelined copies of the
    x tile and the e4m3 weight tile, plus the weight tile converted to x's dtype for tl.dot."""
    return max(stages - 1, 1) * block_k * (block_m * x_bytes + block_n) + block_n * block_k * x_bytes


def fit_shared_memory(block_m: int, config: tuple[int, int, int, int], x_bytes: int, limit: int
                      ) -> tuple[int, int, int, int]:
    """config, with fewer pipeline stages and then a smaller BLOCK_K until it fits `limit` bytes (unchanged
    where it fits: the 16-bit serving configs; fp32 activations need twice the x tile)."""
    block_n, block_k, warps, stages = config
    while shared_memory_bytes(block_m, block_n, block_k, stages, x_bytes) > limit:
        if stages > 2:
            stages -= 1
        elif block_k > 16:
            block_k //= 2
        else:
            raise ValueError(f"w8a16_gemm: no BLOCK_K fits {limit} bytes of shared memory at BLOCK_M {block_m}, "
                             f"BLOCK_N {block_n}; pass a config with a smaller BLOCK_N")
    return block_n, block_k, warps, stages


def w8a16_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, split_k: int | None = None,
               config: tuple[int, int, int, int] | None = None, group_k: int = 0,
               scale_row: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (16/32-bit float), weight e4m3 [N, K], scale float32 [N] (group_k 0) or [R, ceil(K / group_k)]
    with scale_row int32 [N] -> [M, N] in x's dtype. split_k None: chosen from the shapes (split only when the
    N tiles alone leave SMs idle)."""
    assert x.dim() == 2 and weight.shape[1] == x.shape[1] and weight.stride(1) == 1
    assert not group_k or (scale.dim() == 2 and scale.stride(1) == 1 and scale_row is not None)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(min(m, 64)))
    block_n, block_k, warps, stages = fit_shared_memory(block_m, config or CONFIG, x.element_size(),
                                                        shared_memory_limit(x.device))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    if split_k is None:
        sms = splits.num_sms(x.device)
        split_k = 1 if tiles >= sms else max(1, min(triton.cdiv(2 * sms, tiles), k // (4 * block_k)))
    split_k, k_per_split = splits.split_in_tiles(k, split_k, block_k)
    out, stride_os = splits.partials(m, n, split_k, x.dtype, x.device)
    if m == 0:
        return splits.finish(out, split_k, x.dtype)
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    _w8a16_kernel[grid](
        x, weight, scale, scale_row if group_k else scale, out, m, n, k, x.stride(0), weight.stride(0),
        scale.stride(0) if group_k else 0, n,
        stride_os, k_per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", GROUP_K=group_k, num_warps=warps,
        num_stages=stages,
    )
    return splits.finish(out, split_k, x.dtype)
