"""Fused elementwise Triton kernels for the GPU path: residual-add + RMSNorm (and Gemma's norm, add, norm),
rotary (after a per-head q/k RMSNorm where the model has one), SiLU*mul, and the RMSNorm / SiLU*mul variants
that quantize their output per token for an FP8 GEMM (W8A8) in the same pass.

Unfused, these are ~40 tiny kernels per layer; at batch 1 their launch gaps cost more than the
weight reads. Each kernel rounds its intermediates to the activation dtype where HF's eager code
does, so bf16 results match HF transformers' rounding step for step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.ops.fp8_quant import Fp8Activation, empty_fp8_rows, quantize_row, row_warps


@triton.jit
def _rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, n_cols, eps, stride_x, stride_r, stride_ro,
                  HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """norm(x [+ residual]) of one row in the activation dtype (padding columns 0); stores x + residual."""
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # HF adds in the activation dtype
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    return _weighted_norm(x, w_ptr, cols, mask, n_cols, eps)


@triton.jit
def _weighted_norm(x, w_ptr, cols, mask, n_cols, eps):
    """w * norm(x) of one loaded row (padding columns 0), normed x rounded to its dtype first, as HF's Llama."""
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    y = _rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, n_cols, eps, stride_x, stride_r, stride_ro,
                      HAS_RESIDUAL, BLOCK)
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + row * stride_o + cols, y, mask=cols < n_cols)


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, s_in_ptr, res_out_ptr, n_cols, eps,
                         stride_x, stride_r, stride_ro,
                         HAS_RESIDUAL: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr):
    """RMSNorm whose output goes straight to an FP8 GEMM: the normed row (rounded to the activation dtype, as
    the 16-bit kernel stores it) quantized per token, never written in 16 bits."""
    row = tl.program_id(0).to(tl.int64)
    y = _rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, n_cols, eps, stride_x, stride_r, stride_ro,
                      HAS_RESIDUAL, BLOCK)
    q, scale = quantize_row(y.to(tl.float32), s_in_ptr, STATIC)
    cols = tl.arange(0, BLOCK)
    tl.store(q_ptr + row * n_cols + cols, q, mask=cols < n_cols)
    tl.store(s_ptr + row, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Same contract as layers.RMSNorm.forward: with a residual returns (norm(x + r), x + r)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n_rows, n_cols = x2.shape
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    r2 = residual.reshape(-1, n_cols) if residual is not None else x2
    if n_rows:
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, out, res_out, n_cols, eps,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
            num_warps=row_warps(triton.next_power_of_2(n_cols)),  # as rms_norm_fp8: the same sum, bit for bit
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _norm_add_norm_kernel(x_ptr, res_ptr, w_first_ptr, w_second_ptr, out_ptr, res_out_ptr, n_cols, eps_first,
                          eps_second, stride_x, stride_r, stride_o, stride_ro, BLOCK: tl.constexpr):
    """One row of rms_norm(rms_norm(x, w_first), w_second, residual): the first norm's output never leaves
    registers."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    first = _weighted_norm(x, w_first_ptr, cols, mask, n_cols, eps_first)
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    summed = (first.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(res_out_ptr + row * stride_ro + cols, summed, mask=mask)
    out = _weighted_norm(summed, w_second_ptr, cols, mask, n_cols, eps_second)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def norm_add_norm(x: torch.Tensor, residual: torch.Tensor, weight_first: torch.Tensor, eps_first: float,
                  weight_second: torch.Tensor, eps_second: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(rms_norm(x, weight_first), weight_second, residual) in one pass, bit for bit: returns
    (norm_second(residual + norm_first(x)), residual + norm_first(x)). Gemma's post-attention norm, the
    residual add and its pre-feed-forward norm, which unfused read and write the hidden states six times."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    r2 = residual.reshape(-1, shape[-1])
    n_rows, n_cols = x2.shape
    out, res_out = torch.empty_like(x2), torch.empty_like(x2)
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _norm_add_norm_kernel[(n_rows,)](
            x2, r2, weight_first, weight_second, out, res_out, n_cols, eps_first, eps_second,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            BLOCK=block, num_warps=row_warps(block),  # rms_norm's warps: the same sums, bit for bit
        )
    return out.view(shape), res_out.view(shape)


@triton.jit
def _rotate_heads(base, cos, sin, eps, w_ptr, num_heads, NORM: tl.constexpr, HALF: tl.constexpr,
                  HALF_P: tl.constexpr, HEADS_P: tl.constexpr, stride_h):
    """Rotates (rotate-half) the heads of one token at `base` in place; with NORM each head is first RMS-normed
    over its HALF * 2 dims with weight w (as _rms_norm_row: normed rounded to the activation dtype, then times
    w, rounded again)."""
    d = tl.arange(0, HALF_P)
    d_ok = d < HALF
    h = tl.arange(0, HEADS_P)
    mask = (h[:, None] < num_heads) & d_ok[None, :]
    ptrs = base + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    if NORM:
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        var = (tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * HALF)
        rstd = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1f * rstd).to(dt).to(tl.float32)).to(dt)
        x2 = (w2 * (x2f * rstd).to(dt).to(tl.float32)).to(dt)
    c = cos.to(dt).to(tl.float32)[None, :]
    s = sin.to(dt).to(tl.float32)[None, :]
    # HF: x * cos + rotate_half(x) * sin, each product and the sum rounded to the activation dtype.
    o1 = ((x1.to(tl.float32) * c).to(dt).to(tl.float32) - (x2.to(tl.float32) * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2.to(tl.float32) * c).to(dt).to(tl.float32) + (x1.to(tl.float32) * s).to(dt).to(tl.float32)).to(dt)
    tl.store(ptrs, o1, mask=mask)
    tl.store(ptrs + HALF, o2, mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, qw_ptr, kw_ptr, eps, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_cs, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, NORM: tl.constexpr,
                   HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, HALF_P)
    cos = tl.load(cos_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0)
    _rotate_heads(q_ptr + tok * stride_qt, cos, sin, eps, qw_ptr, NUM_Q_HEADS, NORM, HALF, HALF_P, HEADS_P, stride_qh)
    _rotate_heads(k_ptr + tok * stride_kt, cos, sin, eps, kw_ptr, NUM_K_HEADS, NORM, HALF, HALF_P, HEADS_P, stride_kh)


def apply_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0):
    """In place on q [T, H, D] and k [T, Hkv, D] (views into the qkv output); cos/sin [max_pos, D/2] fp32.
    `norm_weights` (q's [D], k's [D]): each head is RMS-normed first (Qwen3's and Gemma 3's q/k norms), in the
    same pass: the strided views are read once, with no copy to make them contiguous for a row kernel."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    half = head_dim // 2
    qw, kw = norm_weights if norm_weights is not None else (cos, cos)  # unread without NORM
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, cos, sin, positions, qw, kw, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, NORM=norm_weights is not None,
            HALF=half, HALF_P=triton.next_power_of_2(half),
            HEADS_P=triton.next_power_of_2(max(num_q_heads, num_k_heads)), num_warps=4,
        )
    return q, k


@triton.jit
def _silu_mul_cols(x_ptr, row, cols, mask, n_cols, stride_x):
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # HF: silu rounded, then the product rounded
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    mask = cols < n_cols
    tl.store(out_ptr + row * stride_o + cols, _silu_mul_cols(x_ptr, row, cols, mask, n_cols, stride_x), mask=mask)


@triton.jit
def _silu_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, s_in_ptr, n_cols, stride_x, STATIC: tl.constexpr,
                         BLOCK: tl.constexpr):
    """SiLU*mul feeding an FP8 GEMM: one program holds a whole row (the per-token scale needs its max)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = _silu_mul_cols(x_ptr, row, cols, mask, n_cols, stride_x)
    q, scale = quantize_row(tl.where(mask, y.to(tl.float32), 0.0), s_in_ptr, STATIC)
    tl.store(q_ptr + row * n_cols + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _gelu_tanh_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    y = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
    tanh = 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)  # finite at both ends
    act = (0.5 * g * (1.0 + tanh)).to(gate.dtype)  # HF: gelu rounded, then the product rounded
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> gelu_tanh(gate) * up, [T, I] (Gemma's MLP)."""
    n_rows, two_i = x.shape
    n_cols = two_i // 2
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    block = 1024
    if n_rows:
        _gelu_tanh_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](x, out, n_cols, x.stride(0), out.stride(0),
                                                                     BLOCK=block, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    n_rows, two_i = x.shape
    n_cols = two_i // 2
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    block = 1024
    if n_rows:
        _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](x, out, n_cols, x.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 static_scale: torch.Tensor | None = None):
    """rms_norm whose output is quantized per token for torch._scaled_mm: an Fp8Activation holding exactly
    fp8_quant.quantize_per_token(rms_norm(x, ...), static_scale); with a residual, (that, x + residual)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n_rows, n_cols = x2.shape
    q, scale = empty_fp8_rows(n_rows, n_cols, x.device)
    res_out = torch.empty_like(x2) if residual is not None else x2  # unwritten without a residual
    r2 = residual.reshape(-1, n_cols) if residual is not None else x2
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_fp8_kernel[(n_rows,)](
            x2, r2, weight, q.view(torch.uint8), scale, static_scale if static_scale is not None else scale, res_out,
            n_cols, eps, x2.stride(0), r2.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, STATIC=static_scale is not None, BLOCK=block,
            num_warps=row_warps(block),
        )
    out = Fp8Activation(q, scale, x.dtype)
    return out if residual is None else (out, res_out.view(shape))


def silu_and_mul_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> Fp8Activation:
    """silu_and_mul quantized per token for torch._scaled_mm: exactly
    fp8_quant.quantize_per_token(silu_and_mul(x), static_scale), without the 16-bit intermediate."""
    n_rows, two_i = x.shape
    n_cols = two_i // 2
    q, scale = empty_fp8_rows(n_rows, n_cols, x.device)
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _silu_mul_fp8_kernel[(n_rows,)](
            x, q.view(torch.uint8), scale, static_scale if static_scale is not None else scale, n_cols, x.stride(0),
            STATIC=static_scale is not None, BLOCK=block, num_warps=row_warps(block),
        )
    return Fp8Activation(q, scale, x.dtype)
