"""Which kernel multiplies activations by packed int4/int8 weights, chosen from shapes alone (no host
syncs, so the choice is fixed inside a CUDA graph). The whole rule is INT_PATHS below, by rows M:

* "skinny" (decode): the split-K skinny kernel (kvserve/ops/triton_int_gemv.py), weight-read bound.
* "mma": the tensor-core GEMM that unpacks the weight in registers (kvserve/ops/triton_int_mma.py): reads
  the packed weight once, K * N / 2 bytes at int4, where dequantize + cuBLAS moves ~4.5 bytes per weight.
* "dequant": dequantize W into a [K, N] scratch of x's dtype (kvserve/ops/triton_int_dequant.py), then
  cuBLAS: at prefill sizes the GEMM is compute bound and cuBLAS's tiles win. Scratch: K * N * 2 bytes per
  call for bf16 (gate_up of Llama-3.1-8B: 235 MB), returned to PyTorch's caching allocator right after the
  matmul, so consecutive layers reuse it.
The buckets and launch configurations come from `benchmarks/ab_kernels.py --only int4` on the H200
(Llama-3.1-8B's four linear shapes, AWQ group 128; it prints this table next to its measurements).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvserve.ops.split_k import num_sms

SKINNY_MAX_M = 16
# Skinny launch (BLOCK_N, BLOCK_K, num_warps, num_stages). M == 1: 128 columns x 16 int4 words per
# step, one FMA per weight in registers. M > 1: tl.dot needs 16 words (BLOCK_K = 16 * PACK); 128 columns
# and 8 warps were faster than 64 and 4 at M = 4 and 16 on every shape.
SKINNY_M1_CONFIG = (128, 128, 4, 3)
SKINNY_DOT_CONFIG = (128, 128, 8, 3)
# Split-K: about PROGRAMS_PER_SM programs per SM in all (M == 1: twice as many, 3-17% faster there),
# each still at least MIN_K_TILES tiles of K.
PROGRAMS_PER_SM = 4
PROGRAMS_PER_SM_M1 = 8
MIN_K_TILES = 4


def skinny_config(m: int, bits: int, config: tuple[int, int, int, int] | None = None) -> tuple[int, int, int, int]:
    """The skinny launch for m rows (tl.dot needs 16 words per K step: BLOCK_K at least 16 * PACK)."""
    block_n, block_k, warps, stages = config or (SKINNY_M1_CONFIG if m == 1 else SKINNY_DOT_CONFIG)
    pack = 32 // bits
    return block_n, max(block_k, 16 * pack) if m > 1 else block_k, warps, stages


def skinny_split_k(n: int, k: int, device: torch.device, config: tuple[int, int, int, int], m: int = 2) -> int:
    block_n, block_k = config[0], config[1]
    tiles = -(-n // block_n)
    want = -(-(PROGRAMS_PER_SM_M1 if m == 1 else PROGRAMS_PER_SM) * num_sms(device) // tiles)
    return max(1, min(want, k // (MIN_K_TILES * block_k)))


class IntPath(NamedTuple):
    max_rows: int  # serves M up to this (and above the previous entry's)
    kernel: str  # "skinny", "mma" or "dequant"
    config: tuple | None  # the kernel's launch configuration; dequant: none


# The tensor-core GEMM's launch by row bucket (the smallest key >= M): (BLOCK_N, BLOCK_M, BLOCK_K, num_warps,
# num_stages). BLOCK_N takes the MMA's M side (64 per warpgroup), BLOCK_M the rows.
MMA_CONFIGS = {
    16: (128, 16, 64, 4, 4),
    32: (128, 32, 64, 4, 4),
    64: (128, 64, 64, 4, 4),
    128: (128, 128, 64, 8, 3),
    256: (128, 128, 64, 8, 3),
}


def mma_config(m: int) -> tuple[int, int, int, int, int]:
    return MMA_CONFIGS[min((b for b in MMA_CONFIGS if b >= m), default=max(MMA_CONFIGS))]


# Measured on the H200 (2026-12-02, `benchmarks/ab_kernels.py --only int4`, BENCHMARKS.md): summed over
# Llama-3.1-8B's four shapes the mma kernel wins at 32, 64 and 128 rows, loses to the skinny kernel at 1-16 rows
# and to dequantize + cuBLAS at 256 rows.
INT_PATHS: tuple[IntPath, ...] = (
    IntPath(1, "skinny", SKINNY_M1_CONFIG),
    IntPath(SKINNY_MAX_M, "skinny", SKINNY_DOT_CONFIG),
    IntPath(32, "mma", mma_config(32)),
    IntPath(64, "mma", mma_config(64)),
    IntPath(128, "mma", mma_config(128)),
    IntPath(256, "dequant", None),
    IntPath(1 << 62, "dequant", None),
)


def int_path(m: int) -> IntPath:
    return next(p for p in INT_PATHS if m <= p.max_rows)


def int_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """x [M, K] @ dequant(qweight) [K, N] -> [M, N] in x's dtype."""
    m, k = x.shape
    path = int_path(m)
    if path.kernel == "skinny":
        from kvserve.ops.triton_int_gemv import skinny_int_gemm

        config = skinny_config(m, bits, path.config)
        split = skinny_split_k(qweight.shape[1], k, x.device, config, m)
        return skinny_int_gemm(x, qweight, scales, zeros, g_idx, bits, group_size, split, config)
    if path.kernel == "mma":
        from kvserve.ops.triton_int_mma import mma_int_gemm

        return mma_int_gemm(x, qweight, scales, zeros, g_idx, bits, group_size, path.config)
    from kvserve.ops.triton_int_dequant import dequantize_int

    return torch.matmul(x, dequantize_int(qweight, scales, zeros, g_idx, bits, group_size, x.dtype))
