"""The fused elementwise kernels of the GPU path (kvserve/ops/fused_kernels.py) against torch written as HF
writes it, in both kernel tiers (tests/triton_interpreter.py): residual-add + RMSNorm, rotary, SiLU*mul,
and the FP8 variants that also quantize their output per token for the next GEMM."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import INTERPRETED, KERNEL_DEVICE, KERNEL_TIER, gpu_tier_cases

pytest.importorskip("triton")

pytestmark = KERNEL_TIER
DEVICE = KERNEL_DEVICE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# One rounding step of the dtype: the kernels' exp/rsqrt may differ from torch's in the last fp32 bit, which
# can move a 16-bit result by one step (the interpreter also truncates to bf16 where the GPU rounds).
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2 if INTERPRETED else 8e-3}


def _rms_norm_reference(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, residual)


def _rows(n_rows, n_cols, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_rows, n_cols, generator=g) * torch.logspace(-2, 1, n_rows)[:, None]).to(dtype).to(DEVICE)


def _case_id(dtype, rows, cols, *flags):
    return "-".join([DTYPE_IDS[DTYPES.index(dtype)], f"{rows}x{cols}", *flags])


# Compiled: every dtype with the residual add (every layer's norm but the first), the plain norm in bf16.
@pytest.mark.parametrize("dtype,n_rows,n_cols,with_residual", gpu_tier_cases(
    [(dtype, rows, cols, res) for dtype, (rows, cols), res in itertools.product(
        DTYPES, [(3, 64), (5, 4096), (2, 1000)], ["plain", "residual"])],
    lambda dtype, rows, cols, res: dtype == torch.bfloat16 or res == "residual", _case_id))
def test_rms_norm(dtype, n_rows, n_cols, with_residual):
    from kvserve.ops.fused_kernels import rms_norm

    x, r = _rows(n_rows, n_cols, dtype, 1), _rows(n_rows, n_cols, dtype, 2)
    weight = (1 + 0.1 * _rows(1, n_cols, torch.float32, 3)[0]).to(dtype)
    residual = r if with_residual == "residual" else None
    got = rms_norm(x, weight, 1e-5, residual)
    want = _rms_norm_reference(x, weight, 1e-5, residual)
    if residual is not None:  # x + r: one rounding of the same sum (the interpreter truncates bf16)
        exact = not (INTERPRETED and dtype == torch.bfloat16)
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0 if exact else TOL[dtype])
        got, want = got[0], want[0]
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n_rows,intermediate", [(1, 128), (7, 14336 // 8), (3, 1000)])
def test_silu_and_mul(dtype, n_rows, intermediate):
    from kvserve.ops.fused_kernels import silu_and_mul

    gate_up = _rows(n_rows, 2 * intermediate, dtype, 4)
    gate, up = gate_up.split(intermediate, dim=-1)
    got = silu_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == (n_rows, intermediate)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_gemma_rms_norm_fused(dtype, with_residual):
    """Gemma's (1 + w) norm on the fused path against HF's maths (fp32 throughout, one rounding)."""
    from kvserve.model.layers import GemmaRMSNorm

    x, r = _rows(4, 256, dtype, 6), _rows(4, 256, dtype, 7)
    norm = GemmaRMSNorm(256, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(0.1 * _rows(1, 256, torch.float32, 8)[0])
    residual = r if with_residual else None
    got = norm(x, residual)
    xs = x + r if with_residual else x
    xf = xs.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + norm.weight.float())).to(dtype)
    if with_residual:
        got = got[0]
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n_rows,intermediate", [(1, 128), (3, 1000)])
def test_gelu_tanh_and_mul(dtype, n_rows, intermediate):
    from kvserve.ops.fused_kernels import gelu_tanh_and_mul

    gate_up = _rows(n_rows, 2 * intermediate, dtype, 5)
    gate, up = gate_up.split(intermediate, dim=-1)
    got = gelu_tanh_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == (n_rows, intermediate)
    torch.testing.assert_close(got, F.gelu(gate, approximate="tanh") * up, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 32), (32, 8, 128), (6, 2, 48)])
def test_rotary_in_place_on_qkv_views(dtype, num_heads, num_kv_heads, head_dim):
    from kvserve.model.layers import RotaryEmbedding, _rotate
    from kvserve.ops.fused_kernels import apply_rotary_

    rope = RotaryEmbedding(head_dim, 512, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    t = 9
    qkv = _rows(t, (num_heads + 2 * num_kv_heads) * head_dim, dtype, 5)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 65, 300, 511], device=DEVICE)
    cos = rope.cos_cached.to(DEVICE)[positions].unsqueeze(1)
    sin = rope.sin_cached.to(DEVICE)[positions].unsqueeze(1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    want_q, want_k = _rotate(q.clone(), cos, sin), _rotate(k.clone(), cos, sin)
    apply_rotary_(positions, q, k, rope.cos_cached.to(DEVICE), rope.sin_cached.to(DEVICE))
    # x1 * cos - x2 * sin cancels: a rounding step of the operands' scale, not of the result's.
    atol = TOL[dtype] * float(qkv.abs().max())
    torch.testing.assert_close(q, want_q, atol=atol, rtol=TOL[dtype])
    torch.testing.assert_close(k, want_k, atol=atol, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("norm_kind", ["qwen3", "gemma"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 32), (16, 8, 256), (6, 2, 48)])
def test_rotary_after_per_head_norm_on_qkv_views(dtype, norm_kind, num_heads, num_kv_heads, head_dim):
    """Per-head q/k RMSNorm fused into the rotary pass (Qwen3's weight, Gemma 3's 1 + weight) equals the norm
    as HF writes it followed by the rotary, each head over its own dims; v and the other rows untouched."""
    from kvserve.model.layers import GemmaRMSNorm, RMSNorm, RotaryEmbedding, _rotate

    rope = RotaryEmbedding(head_dim, 512, 10000.0)
    t = 9
    qkv = _rows(t, (num_heads + 2 * num_kv_heads) * head_dim, dtype, 11)
    before = qkv.clone()
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim)
    norm_cls = GemmaRMSNorm if norm_kind == "gemma" else RMSNorm
    q_norm, k_norm = norm_cls(head_dim, 1e-6).to(DEVICE), norm_cls(head_dim, 1e-6).to(DEVICE)
    with torch.no_grad():
        q_norm.weight.copy_((0.1 if norm_kind == "gemma" else 1.0) + 0.2 * _rows(1, head_dim, torch.float32, 12)[0])
        k_norm.weight.copy_((0.1 if norm_kind == "gemma" else 1.0) + 0.2 * _rows(1, head_dim, torch.float32, 13)[0])
    if norm_kind == "qwen3":  # Qwen3's norm weights are in the activation dtype
        q_norm.to(dtype), k_norm.to(dtype)

    def hf_norm(x, norm):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        if norm_kind == "gemma":
            return (normed * (1.0 + norm.weight.float())).to(dtype)
        return norm.weight * normed.to(dtype)

    positions = torch.tensor([0, 1, 2, 7, 63, 64, 65, 300, 511], device=DEVICE)
    cos = rope.cos_cached.to(DEVICE)[positions].unsqueeze(1)
    sin = rope.sin_cached.to(DEVICE)[positions].unsqueeze(1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    want_q, want_k = _rotate(hf_norm(q, q_norm), cos, sin), _rotate(hf_norm(k, k_norm), cos, sin)
    got_q, got_k = rope.to(DEVICE)(positions, q, k, norms=(q_norm, k_norm))
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place, through the views
    # Normed values are O(1): one rounding step of the result (two for Gemma, whose kernel rounds normed x first).
    tol = TOL[dtype] * (2 if norm_kind == "gemma" else 1)
    torch.testing.assert_close(got_q, want_q, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(v, before[:, (num_heads + num_kv_heads) * head_dim:], atol=0, rtol=0)


def _same_fp8(got, q, scale, dtype):
    assert got.dtype == dtype and got.q.dtype == torch.float8_e4m3fn and got.scale.shape == scale.shape
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.scale, scale)


# Compiled: the 16-bit dtypes an FP8 model serves in, fp16 on the served flags (residual add, dynamic scales)
# and every flag in bf16; fp32 and the rest of the cross product only add compile time there.
@pytest.mark.parametrize("dtype,n_rows,n_cols,with_residual,static", gpu_tier_cases(
    [(dtype, rows, cols, res, static) for dtype, (rows, cols), res, static in itertools.product(
        DTYPES, [(3, 64), (5, 4096), (2, 1000)], ["plain", "residual"], ["dynamic", "static"])],
    lambda dtype, rows, cols, res, static: dtype == torch.bfloat16 or (
        dtype == torch.float16 and (res, static) == ("residual", "dynamic")), _case_id))
def test_rms_norm_fp8_is_rms_norm_then_per_token_quant(dtype, n_rows, n_cols, with_residual, static):
    """Bit for bit the unfused pair: the 16-bit RMSNorm kernel, then the per-token quantization kernel."""
    from kvserve.ops.fp8_quant import quantize_per_token
    from kvserve.ops.fused_kernels import rms_norm, rms_norm_fp8

    x, r = _rows(n_rows, n_cols, dtype, 6), _rows(n_rows, n_cols, dtype, 7)
    x[0] = 0  # an all-zero row takes the minimum scale
    weight = (1 + 0.1 * _rows(1, n_cols, torch.float32, 8)[0]).to(dtype)
    residual = r if with_residual == "residual" else None
    static_scale = torch.tensor([0.05], device=DEVICE) if static == "static" else None
    want = rms_norm(x, weight, 1e-5, residual)
    got = rms_norm_fp8(x, weight, 1e-5, residual, static_scale)
    if residual is not None:
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    _same_fp8(got, *quantize_per_token(want, static_scale), dtype)


@pytest.mark.parametrize("dtype,n_rows,intermediate,static", gpu_tier_cases(
    [(dtype, rows, cols, static) for dtype, (rows, cols), static in itertools.product(
        DTYPES, [(1, 128), (7, 14336 // 8), (3, 1000)], ["dynamic", "static"])],
    lambda dtype, rows, cols, static: dtype == torch.bfloat16 or (dtype == torch.float16 and static == "dynamic"),
    _case_id))
def test_silu_and_mul_fp8_is_silu_and_mul_then_per_token_quant(dtype, n_rows, intermediate, static):
    from kvserve.ops.fp8_quant import quantize_per_token
    from kvserve.ops.fused_kernels import silu_and_mul, silu_and_mul_fp8

    gate_up = _rows(n_rows, 2 * intermediate, dtype, 9)
    wide = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * intermediate]  # a row stride past the row's end
    static_scale = torch.tensor([0.02], device=DEVICE) if static == "static" else None
    for x in (gate_up, wide):
        _same_fp8(silu_and_mul_fp8(x, static_scale), *quantize_per_token(silu_and_mul(x), static_scale), dtype)


@pytest.mark.parametrize("rows", [16, 40])  # 16: the W8A16 decode path, no fusion; 40: _scaled_mm, fused
def test_fp8_layers_take_their_input_quantized_by_the_producer(rows, monkeypatch):
    """A decoder layer's MLP and norms with FP8 linears: on the _scaled_mm path, post-attention RMSNorm and
    SiLU*mul hand the FP8 GEMMs Fp8Activations (one kernel each, no separate quantization pass), and the
    layer's output is the same, bit for bit, as with the fusion off. Where there is no CUDA, _scaled_mm is
    replaced by its definition (CPUs have no FP8 GEMM)."""
    from types import SimpleNamespace

    from kvserve.model import layers, llama
    from kvserve.model.quantization import fp8
    from kvserve.ops import fp8_quant, fused_kernels

    if DEVICE == "cpu":
        monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, scale_a, scale_b, out_dtype:
                            ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype))
    elif not fp8.cuda_has_fp8(torch.device(DEVICE)):
        pytest.skip("no FP8 tensor cores (compute capability < 8.9)")
    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=256, intermediate_size=512, hidden_act="silu")
    mlp = llama.MLP(cfg, fp8.Fp8Config(checkpoint_is_fp8=False), "layers.0.mlp")
    norm = layers.RMSNorm(256, 1e-5)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.weight.data = (torch.randn_like(linear.weight) * 0.05).to(DEVICE, torch.bfloat16)
        linear.quant_method.process_weights_after_loading(linear)
        linear.fp8_gemm = True  # what process_weights_after_loading decides on an FP8 GPU
    norm.weight.data = (1 + 0.1 * torch.randn(256)).to(DEVICE, torch.bfloat16)
    x, residual = _rows(rows, 256, torch.bfloat16, 10), _rows(rows, 256, torch.bfloat16, 11)

    fused_calls = []
    for name in ("rms_norm_fp8", "silu_and_mul_fp8"):
        original = getattr(fused_kernels, name)
        monkeypatch.setattr(fused_kernels, name, lambda *a, _f=original, _n=name, **k: fused_calls.append(_n) or _f(*a, **k))
    quant_calls = []
    original_quant = fp8_quant.quantize_per_token
    monkeypatch.setattr(fp8_quant, "quantize_per_token", lambda *a, **k: quant_calls.append(1) or original_quant(*a, **k))

    def layer_tail():  # DecoderLayer.forward after attention
        hidden, res = norm(x, residual, consumer=mlp.gate_up_proj)
        return mlp(hidden), res

    fused_out, fused_res = layer_tail()
    assert fused_calls == (["rms_norm_fp8", "silu_and_mul_fp8"] if rows > 16 else [])
    assert quant_calls == []
    monkeypatch.setattr(fp8, "FUSE_ACTIVATION_QUANT", False)
    fused_calls.clear()
    plain_out, plain_res = layer_tail()
    assert fused_calls == [] and len(quant_calls) == (2 if rows > 16 else 0)
    assert torch.equal(fused_out, plain_out) and torch.equal(fused_res, plain_res)


@pytest.mark.parametrize("dtype,n_rows,n_cols", gpu_tier_cases(
    [(dtype, rows, cols) for dtype, (rows, cols) in itertools.product(DTYPES, [(3, 256), (5, 3840), (2, 1000)])],
    lambda dtype, rows, cols: dtype != torch.float32, _case_id))
def test_norm_add_norm_is_two_rms_norms(dtype, n_rows, n_cols):
    """Gemma's post-sublayer norm, residual add and next norm in one kernel: the bits of the two rms_norm calls
    it replaces, and (through GemmaRMSNorm.then_add_norm) of the two layers' torch path within a rounding."""
    from kvserve.model.layers import GemmaRMSNorm
    from kvserve.ops.fused_kernels import norm_add_norm, rms_norm

    x, r = _rows(n_rows, n_cols, dtype, 11), _rows(n_rows, n_cols, dtype, 12)
    first, second = GemmaRMSNorm(n_cols, 1e-6).to(DEVICE), GemmaRMSNorm(n_cols, 1e-5).to(DEVICE)
    with torch.no_grad():
        first.weight.copy_(0.1 * _rows(1, n_cols, torch.float32, 13)[0])
        second.weight.copy_(0.1 * _rows(1, n_cols, torch.float32, 14)[0])
    w1, w2 = first.kernel_weight(), second.kernel_weight()
    out, res = norm_add_norm(x, r, w1, 1e-6, w2, 1e-5)
    want_out, want_res = rms_norm(rms_norm(x, w1, 1e-6), w2, 1e-5, r)
    assert out.dtype == res.dtype == dtype
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)

    got = first.then_add_norm(second, x, r)
    assert torch.equal(got[0], out) and torch.equal(got[1], res)
    # The torch path (what the CPU runs), as HF computes it: fp32 norms, each rounded once.
    def hf_norm(v, norm):
        vf = v.float()
        return (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight.float())).to(dtype)
    hf_res = hf_norm(x, first) + r
    torch.testing.assert_close(res, hf_res, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    torch.testing.assert_close(out, hf_norm(hf_res, second), atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
