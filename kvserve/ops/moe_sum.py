"""The last step of a MoE layer: each token's output is the sum of its K pair rows (already weighted by the
down GEMM), out[t] = sum_k rows[t * K + k], added in fp32 in k order and rounded once to the rows' dtype, as
torch's `rows.view(T, K, H).sum(1)` rounds.

One Triton launch streaming every row once: torch's generic reduction over the middle axis runs well below
the card's bandwidth at decode shapes (BENCHMARKS.md, 2026-12-05).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_pairs_kernel(rows_ptr, out_ptr, H, stride_r, stride_o, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (token * TOP_K + k) * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_pairs(rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """rows [T * top_k, H] (a token's pairs adjacent, unit column stride) -> [T, H] in rows' dtype."""
    if rows.shape[0] % top_k or rows.stride(-1) != 1:
        raise ValueError(f"sum_pairs takes [tokens * {top_k}, H] rows with unit column stride, not "
                         f"{tuple(rows.shape)} with strides {rows.stride()}")
    tokens, hidden = rows.shape[0] // top_k, rows.shape[1]
    out = torch.empty(tokens, hidden, dtype=rows.dtype, device=rows.device)
    if tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    _sum_pairs_kernel[(tokens, triton.cdiv(hidden, block_h))](rows, out, hidden, rows.stride(0), out.stride(0),
                                                              TOP_K=top_k, BLOCK_H=block_h, num_warps=4)
    return out
