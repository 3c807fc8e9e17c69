"""The fused elementwise kernels of the GPU path (kvserve/ops/fused_kernels.py) against torch written as HF
writes it, in both kernel tiers (tests/triton_interpreter.py): residual-add + RMSNorm, rotary, SiLU*mul,
and the FP8 variants that also quantize their output per token for the next GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import INTERPRETED, KERNEL_DEVICE, KERNEL_TIER

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


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n_rows,n_cols", [(3, 64), (5, 4096), (2, 1000)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(dtype, n_rows, n_cols, with_residual):
    from kvserve.ops.fused_kernels import rms_norm

    x, r = _rows(n_rows, n_cols, dtype, 1), _rows(n_rows, n_cols, dtype, 2)
    weight = (1 + 0.1 * _rows(1, n_cols, torch.float32, 3)[0]).to(dtype)
    residual = r if with_residual else None
    got = rms_norm(x, weight, 1e-5, residual)
    want = _rms_norm_reference(x, weight, 1e-5, residual)
    if with_residual:  # x + r: one rounding of the same sum (the interpreter truncates bf16)
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
