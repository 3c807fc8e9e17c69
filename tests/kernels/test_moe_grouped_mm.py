"""Routed experts through torch's grouped GEMM (kvserve/ops/moe_grouped_mm.py) equal the torch reference
(fused_moe_torch): on the CPU (torch's own grouped GEMM there) for 32- and 16-bit experts, with experts on
other ranks and with gpt-oss's biases and activation; on a GPU (the gpu tier: CUTLASS on Hopper) for bf16 and for
fp8 experts on the W8A8 path, also replayed from a CUDA graph; and which steps take the path."""

from __future__ import annotations

import pytest
import torch

from kvserve.ops import moe_grouped_mm
from kvserve.ops.fused_moe import ExpertActivation, fused_moe_torch
from kvserve.ops.moe_grouped_mm import fused_moe_grouped_mm

needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                  reason="needs a Hopper (or newer) GPU")


def _case(tokens, experts, top_k, hidden, inter, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=g).softmax(-1), top_k)
    return tuple(t.to(device) for t in (x, w13, w2, weights, ids))


def _rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (13, 8, 2), (70, 16, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_experts_equal_reference(tokens, experts, top_k, dtype):
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, 64, 48, dtype)
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
    out = fused_moe_grouped_mm(x, w13, w2, weights, ids)
    assert out.dtype == dtype and _rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_grouped_mm_expert_parallel_ranks_sum_to_the_whole_layer():
    x, w13, w2, weights, ids = _case(21, 8, 2, 32, 32, torch.float32)
    halves = []
    for first in (0, 4):
        local = torch.where((ids >= first) & (ids < first + 4), ids - first, -1)
        halves.append(fused_moe_grouped_mm(x, w13[first:first + 4], w2[first:first + 4], weights, local,
                                           all_experts_local=False))
    torch.testing.assert_close(halves[0] + halves[1], fused_moe_torch(x, w13, w2, weights, ids), atol=1e-5,
                               rtol=1e-5)


def test_grouped_mm_with_biases_and_clamped_swiglu_equals_reference():
    x, w13, w2, weights, ids = _case(9, 8, 2, 32, 32, torch.float32)
    g = torch.Generator().manual_seed(1)
    extras = dict(w13_bias=torch.randn(8, 64, generator=g) * 0.1, w2_bias=torch.randn(8, 32, generator=g) * 0.1,
                  activation=ExpertActivation("swiglu_oai"))
    torch.testing.assert_close(fused_moe_grouped_mm(x, w13, w2, weights, ids, **extras),
                               fused_moe_torch(x, w13, w2, weights, ids, **extras), atol=1e-5, rtol=1e-5)


def test_fp8_weight_only_is_refused():
    x, w13, w2, weights, ids = _case(3, 8, 2, 32, 32, torch.float32)
    scales = torch.ones(8, 64), torch.ones(8, 32)
    with pytest.raises(ValueError, match="W8A8"):
        fused_moe_grouped_mm(x, w13, w2, weights, ids, *scales)


def test_which_steps_take_the_grouped_gemm(monkeypatch):
    x = torch.zeros(4, 8)
    monkeypatch.setattr(moe_grouped_mm, "MIN_TOKENS", None)
    assert not moe_grouped_mm.serves(4096, x, False, False)
    monkeypatch.setattr(moe_grouped_mm, "MIN_TOKENS", 1024)
    assert not moe_grouped_mm.serves(4096, x, False, False)  # a CPU tensor: the torch reference serves it
    if torch.cuda.is_available():
        on_gpu = x.cuda().bfloat16()
        assert not moe_grouped_mm.serves(4096, on_gpu.half(), False, False)  # fp16: not in the CUDA library
        hopper = torch.cuda.get_device_capability() >= (9, 0)
        assert moe_grouped_mm.serves(4096, on_gpu, False, False) == hopper
        assert moe_grouped_mm.serves(4096, on_gpu, True, True) == hopper
        assert not moe_grouped_mm.serves(1023, on_gpu, False, False)
        assert not moe_grouped_mm.serves(4096, on_gpu, True, False)  # fp8 weight-only


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("tokens", [1, 64, 2048])
@pytest.mark.parametrize("kind", ["bf16", "fp8_w8a8"])
def test_grouped_mm_on_gpu_equals_reference(tokens, kind):
    """Qwen3-30B-A3B's expert shape; the same call replayed from a CUDA graph gives the same output."""
    from kvserve.model.quantization.fp8_moe import _quantize_experts

    x, w13, w2, weights, ids = _case(tokens, 128, 8, 2048, 768, torch.bfloat16, device="cuda")
    if kind == "bf16":
        args, kw = (x, w13, w2, weights, ids), {}
        ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
    else:
        (q13, s13), (q2, s2) = _quantize_experts(w13), _quantize_experts(w2)
        args, kw = (x, q13, q2, weights, ids, s13, s2), {"quantize_activations": True}
        ref = fused_moe_torch(x, q13, q2, weights, ids, s13, s2, quantize_activations=True)
    out = fused_moe_grouped_mm(*args, **kw)
    if kind == "bf16":
        assert _rel_err(out, ref) < 2e-2
    else:  # sparse e4m3 flips where the two sides round gate_up to different bf16 neighbours: the norm is bounded
        assert (torch.linalg.vector_norm(out.float() - ref.float()) / torch.linalg.vector_norm(ref.float())) < 1e-2
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe_grouped_mm(*args, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = fused_moe_grouped_mm(*args, **kw)
    graph.replay()
    torch.testing.assert_close(captured, out, atol=0, rtol=0)
