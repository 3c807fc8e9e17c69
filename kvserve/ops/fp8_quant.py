"""FP8 (e4m3fn) quantization in Triton: dynamic per-token activation scales for the W8A8 GEMM.

``e4m3_bits`` encodes fp32 as e4m3fn bytes with integer ops (round to nearest even, subnormals included),
bit for bit what torch's ``.to(torch.float8_e4m3fn)`` gives: Triton's own float -> fp8 cast rounds wrongly
near powers of two under the interpreter (TRITON_INTERPRET=1), so a native cast could not be checked on
CPU; the encoding is a handful of integer ops in kernels that are bound by memory anyway. Divisions use
``div_rn`` (IEEE, as torch), not the GPU's default approximate fp32 division.

``quantize_per_token`` is one kernel per call (one program per row, one read of the row): no host syncs
and a fixed allocation per shape, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvserve.ops import fp8_e4m3

FP8_MAX = tl.constexpr(fp8_e4m3.FP8_MAX)
MIN_SCALE = tl.constexpr(fp8_e4m3.MIN_SCALE)  # the torch reference's clamp


@triton.jit
def e4m3_bits(x):
    """fp32 -> e4m3fn byte (uint8): clamped to +-448 first (e4m3fn has no infinity), NaN stays NaN."""
    xc = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    bits = xc.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal results (|x| >= 2**-6): rebias the exponent (127 -> 7) and keep 3 mantissa bits, RNE.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal results: multiples of 2**-9 (exact in fp32), rounded half to even; 8 is 2**-6, byte 0x08.
    y = tl.abs(xc) * 512.0
    q = tl.floor(y)
    frac = y - q
    qi = q.to(tl.int32)
    sub = qi + ((frac > 0.5) | ((frac == 0.5) & ((qi & 1) == 1))).to(tl.int32)
    mag = tl.where(a >= 0x3C800000, normal, sub)
    is_nan = (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, 0x7F, mag | sign).to(tl.uint8)


@triton.jit
def quantize_row(x, s_in_ptr, STATIC: tl.constexpr):
    """One row of fp32 activations (padding entries 0) -> (e4m3 bytes, its scale): the dynamic per-token scale
    max |x| / 448 (at least MIN_SCALE), or with STATIC the per-tensor input scale at s_in_ptr. Shared by the
    kernels that quantize their own output for the next GEMM (kvserve/ops/fused_kernels.py)."""
    if STATIC:
        scale = tl.load(s_in_ptr)
    else:
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    return e4m3_bits(tl.math.div_rn(x, scale)), scale


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, s_ptr, s_in_ptr, n_cols, stride_x, stride_q,
                            STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_row(x, s_in_ptr, STATIC)
    tl.store(q_ptr + row * stride_q + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)


class Fp8Activation(NamedTuple):
    """Activations quantized per token for torch._scaled_mm: e4m3 [M, K], float32 scales [M, 1], and the
    activation dtype they stand for (the GEMM's output dtype). A kernel that produces a GEMM's input (RMSNorm,
    SiLU*mul) hands this to an FP8 linear layer instead of a 16-bit tensor: no separate quantization pass."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def row_warps(block: int) -> int:
    """num_warps for one program per row of `block` (a power of two) columns held in registers."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def empty_fp8_rows(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [m, k], float32 scales [m, 1]) to be filled by a quantizing kernel."""
    return (torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((m, 1), dtype=torch.float32, device=device))


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]); the same values as the torch reference
    ``kvserve.ops.fp8_e4m3.quantize_per_token``. With ``static_scale`` (float32 [1]) every
    row uses that scale: x / static_scale, clamped (the reference's static-input path)."""
    assert x.dim() == 2
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    q, scale = empty_fp8_rows(m, k, x.device)
    if m == 0:
        return q, scale
    block = triton.next_power_of_2(k)
    s_in = static_scale if static_scale is not None else scale  # unread when dynamic
    _quant_per_token_kernel[(m,)](x, q.view(torch.uint8), scale, s_in, k, x.stride(0), k,
                                  STATIC=static_scale is not None, BLOCK=block, num_warps=row_warps(block))
    return q, scale
