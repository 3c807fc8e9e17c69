"""Which kernel multiplies activations by packed int4/int8 weights, chosen from shapes alone (no host
syncs, so the choice is fixed inside a CUDA graph). The whole rule lives here.

* M <= SKINNY_MAX_M (decode): the split-K skinny kernel (triton_int_gemv.py), weight-read bound.
* above it: dequantize W into a [K, N] scratch of x's dtype, then cuBLAS. Dequantizing costs
  ~K*N*(bits/8 + 2) bytes of traffic, a few percent of a 256-row GEMM's time. Scratch: K * N * 2 bytes per
  call for bf16 (gate_up of Llama-3.1-8B: 235 MB), returned to PyTorch's caching allocator right after the
  matmul, so consecutive layers reuse it. (A fused dequantize-GEMM that never materialized W lost to it
  2.6-4x at M = 64 on three of W1's four shapes and 5,217 vs 8,029 tok/s on W1, and was removed.)
The thresholds and launch configurations come from benchmarks/sweep_int4_linear.py on the H200 (W1's four
shapes, AWQ group 128) and benchmarks/gpu_quant.py's A/B rows (BENCHMARKS.md has the tables).
"""

from __future__ import annotations

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


def skinny_config(m: int, bits: int) -> tuple[int, int, int, int]:
    block_n, block_k, warps, stages = SKINNY_M1_CONFIG if m == 1 else SKINNY_DOT_CONFIG
    pack = 32 // bits
    return block_n, max(block_k, 16 * pack) if m > 1 else block_k, warps, stages


def skinny_split_k(n: int, k: int, device: torch.device, config: tuple[int, int, int, int], m: int = 2) -> int:
    block_n, block_k = config[0], config[1]
    tiles = -(-n // block_n)
    want = -(-(PROGRAMS_PER_SM_M1 if m == 1 else PROGRAMS_PER_SM) * num_sms(device) // tiles)
    return max(1, min(want, k // (MIN_K_TILES * block_k)))


def int_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """x [M, K] @ dequant(qweight) [K, N] -> [M, N] in x's dtype."""
    m, k = x.shape
    if m <= SKINNY_MAX_M:
        from kvserve.ops.triton_int_gemv import skinny_int_gemm

        config = skinny_config(m, bits)
        split = skinny_split_k(qweight.shape[1], k, x.device, config, m)
        return skinny_int_gemm(x, qweight, scales, zeros, g_idx, bits, group_size, split, config)
    from kvserve.ops.triton_int_dequant import dequantize_int

    return torch.matmul(x, dequantize_int(qweight, scales, zeros, g_idx, bits, group_size, x.dtype))
