"""Which kernel multiplies activations by an FP8 linear layer's weight on GPUs with FP8 tensor cores, chosen
from the rows M alone (no host syncs: the choice is fixed inside a CUDA graph). The whole rule is FP8_PATHS:

* "gemv" (decode): the one-launch W8A16 weight-streaming kernel (kvserve/ops/triton_fp8_gemv.py).
* "w8a16": the earlier W8A16 kernel (kvserve/ops/triton_fp8_gemm.py), split-K partials summed after it.
* "scaled_mm": W8A8, activations quantized per token (by one Triton kernel, or already by the RMSNorm or
  SiLU*mul kernel that produced them) and torch._scaled_mm on the FP8 tensor cores.
The buckets and launch configurations come from `benchmarks/ab_kernels.py --only fp8` on the H200 (Llama-3.1-8B's
four linear shapes; it prints this table next to its measurements).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Fp8Path(NamedTuple):
    max_rows: int  # serves M up to this (and above the previous entry's)
    kernel: str  # "gemv", "w8a16" or "scaled_mm"
    config: tuple | None  # the kernel's (BLOCK_N, BLOCK_K, num_warps, num_stages); None: its default


# The one-launch decode kernel's launch for one row and for 2-16 rows: (BLOCK_N, BLOCK_K, num_warps, num_stages).
GEMV_CONFIGS = {1: (16, 512, 4, 3), 16: (64, 256, 4, 4)}

# Measured on the H200 (2026-12-02, `benchmarks/ab_kernels.py --only fp8`, BENCHMARKS.md): the one-launch kernel
# wins at one row (1.17-1.37x per shape) and loses to the earlier W8A16 kernel at 8 and 16 rows.
FP8_PATHS: tuple[Fp8Path, ...] = (
    Fp8Path(1, "gemv", GEMV_CONFIGS[1]),
    Fp8Path(16, "w8a16", None),
    Fp8Path(1 << 62, "scaled_mm", None),
)


def fp8_path(m: int) -> Fp8Path:
    return Fp8Path(*next(p for p in FP8_PATHS if m <= p[0]))


def weight_streaming_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, path: Fp8Path) -> torch.Tensor:
    """x [M, K] @ (weight e4m3 [N, K] * scale [N, None])^T -> [M, N] in x's dtype, by a W8A16 path."""
    if path.kernel == "gemv":
        from kvserve.ops.triton_fp8_gemv import fp8_gemv

        return fp8_gemv(x, weight, scale, path.config)
    from kvserve.ops.triton_fp8_gemm import w8a16_gemm

    return w8a16_gemm(x, weight, scale, config=path.config)
