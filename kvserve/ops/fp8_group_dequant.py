"""e4m3 weights with group scales along K (block-wise FP8 checkpoints, as quantization/fp8_block.py serves them)
dequantized into the activation dtype: w [N, K] * scale[r[n], k // group_k] -> [N, K] (r: the scale row of each
output row), for cuBLAS at prefill sizes.

Each element is computed in fp32 and rounded once, the same values as the W8A16 kernel's tiles
(kvserve/ops/triton_fp8_gemm.py with group_k) and as the torch reference `dequantize_groups`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, r_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                    GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n[:, None].to(tl.int64)
    w = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    s_rows = tl.load(r_ptr + offs_n, mask=offs_n < N, other=0).to(tl.int64)
    s = tl.load(s_ptr + s_rows[:, None] * stride_sn + (offs_k // GROUP_K)[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows * stride_on + offs_k[None, :], (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty),
             mask=mask)


def dequantize_groups_triton(weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, group_k: int,
                             dtype: torch.dtype) -> torch.Tensor:
    """weight e4m3 [N, K] (K contiguous), scale float32 [R, ceil(K / group_k)], scale_row int32 [N] -> [N, K]
    in dtype."""
    assert weight.stride(1) == 1 and scale.stride(1) == 1
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    if n and k:
        block_n, block_k = 32, 128
        _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
            weight, scale, scale_row, out, n, k, weight.stride(0), scale.stride(0), out.stride(0),
            GROUP_K=group_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )
    return out


def dequantize_groups(weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, group_k: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The torch reference of dequantize_groups_triton; also for stacked weights [..., N, K] with scales
    [..., R, ceil(K / group_k)]."""
    k = weight.shape[-1]
    rows = scale.float().index_select(-2, scale_row.long())
    return (weight.float() * rows.repeat_interleave(group_k, dim=-1)[..., :k]).to(dtype)
