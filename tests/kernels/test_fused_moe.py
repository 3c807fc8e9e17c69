"""The routed-experts kernels (kvserve/ops/fused_moe.py): the Triton grouped GEMMs equal the torch reference, on
the CPU under Triton's interpreter (a subprocess with TRITON_INTERPRET=1) and on a GPU (the `gpu` test), for
16/32-bit and fp8 experts, weight-only and W8A8 (the interpreter runs an e4m3 x e4m3 tl.dot exactly; bf16 it
rounds by truncation, so bf16 W8A8 is checked on the GPU only); fp8 experts take the W8A8 path above the
selection table's threshold. The sort of pairs into expert blocks: tests/kernels/test_moe_align.py."""

from __future__ import annotations

import pytest
import torch

from kvserve.ops.fused_moe import fused_moe_torch
from tests.triton_interpreter import INTERPRETED, run_file_in_interpreter

needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter subprocess")


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
def test_fused_moe_kernels_in_interpreter_subprocess():
    pytest.importorskip("triton")
    out = run_file_in_interpreter(__file__)
    assert " passed" in out


def _case(tokens, experts, top_k, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    probs = torch.randn(tokens, experts, generator=g).softmax(-1)
    weights, ids = torch.topk(probs, top_k)
    return x, w13, w2, weights, ids


# Token counts that reach the tile configurations up to 256 pairs per expert: one block per pair (a token's own
# pairs), then sorted blocks for pairs <= 4 E, <= 32 E, more.
TILE_CASES = [(1, 8, 2), (13, 8, 2), (70, 8, 2), (300, 8, 2), (9, 16, 4)]


@pytest.mark.skipif(INTERPRETED, reason="pure Python: runs once, in the parent run")
def test_tile_cases_reach_every_tile_configuration():
    from kvserve.ops.fused_moe import _gemm_config

    reached = {repr(_gemm_config(t * k, e, k)) for t, e, k in TILE_CASES}
    assert len(reached) == 4 and _gemm_config(1 * 2, 8, 2)["PER_PAIR"]


@needs_interpreter
@pytest.mark.parametrize("tokens,experts,top_k", TILE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_fused_moe_equals_torch_reference(tokens, experts, top_k, dtype):
    from kvserve.ops.fused_moe import fused_moe_triton

    x, w13, w2, weights, ids = _case(tokens, experts, top_k, 64, 48, dtype)
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
    out = fused_moe_triton(x, w13, w2, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@needs_interpreter
@pytest.mark.parametrize("tokens", [2, 21], ids=["per-pair", "sorted"])
def test_triton_fused_moe_expert_parallel_rank_sums_only_its_experts(tokens):
    x, w13, w2, weights, ids = _case(tokens, 8, 2, 32, 32, torch.float32)
    full = fused_moe_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(_two_expert_parallel_ranks(x, w13, w2, weights, ids), full, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_triton_fused_moe_fp8_weights_equal_dequantized_reference():
    from kvserve.model.quantization.fp8_moe import _quantize_experts
    from kvserve.ops.fused_moe import fused_moe_triton

    x, w13, w2, weights, ids = _case(11, 8, 2, 64, 32, torch.float32)
    (q13, s13), (q2, s2) = _quantize_experts(w13), _quantize_experts(w2)
    ref = fused_moe_torch(x, q13, q2, weights, ids, s13, s2)
    out = fused_moe_triton(x, q13, q2, weights, ids, s13, s2)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _fp8_case(tokens, experts, top_k, hidden, inter, dtype, seed=0):
    """_case with fp8 experts: (x, w13 e4m3, w2 e4m3, weights, ids, w13_scale, w2_scale)."""
    from kvserve.model.quantization.fp8_moe import _quantize_experts

    x, w13, w2, weights, ids = _case(tokens, experts, top_k, hidden, inter, dtype, seed)
    (q13, s13), (q2, s2) = _quantize_experts(w13), _quantize_experts(w2)
    return x, q13, q2, weights, ids, s13, s2


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _norm_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(got.float() - want.float()) / torch.linalg.vector_norm(want.float())).item()


def _two_expert_parallel_ranks(x, w13, w2, weights, ids, extras=None, scales=None, **kw):
    """The sum of two ranks' outputs, each holding 4 of the 8 experts (and their biases, and scales if any)."""
    from kvserve.ops.fused_moe import fused_moe_triton

    halves = []
    for first in (0, 4):
        mine = slice(first, first + 4)
        local = torch.where((ids >= first) & (ids < first + 4), ids - first, -1)
        # The biases have a row per expert: each rank holds its experts' rows.
        part = {name: value[mine] if name.endswith("_bias") else value for name, value in (extras or {}).items()}
        rank_scales = () if scales is None else (scales[0][mine], scales[1][mine])
        halves.append(fused_moe_triton(x, w13[mine], w2[mine], weights, local, *rank_scales,
                                       all_experts_local=False, **kw, **part))
    return halves[0] + halves[1]


def _count_quantized_rows(monkeypatch) -> list[int]:
    """The rows of every separate activation-quantization pass (fp8_quant.quantize_per_token) from now on."""
    from kvserve.ops import fp8_quant

    rows, real = [], fp8_quant.quantize_per_token
    monkeypatch.setattr(fp8_quant, "quantize_per_token", lambda t, *a: rows.append(t.shape[0]) or real(t, *a))
    return rows


# W8A8 against its reference: fp32 sums in a different order; fp16: one rounding of gate_up may differ by an ulp.
W8A8_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@needs_interpreter
@pytest.mark.parametrize("tokens,experts,top_k,dtype", [
    (1, 8, 2, torch.float32), (13, 8, 2, torch.float32), (70, 8, 2, torch.float32), (300, 8, 2, torch.float32),
    (9, 16, 4, torch.float32), (13, 8, 2, torch.float16), (70, 8, 2, torch.float16),
])
def test_triton_fused_moe_w8a8_equals_w8a8_reference(tokens, experts, top_k, dtype, monkeypatch):
    """Every tile configuration. x is quantized once per token (not per pair) and the down projection's
    input inside SiLU-and-mul (no pass of its own); weight-only math is farther from the W8A8 reference than
    the tolerance by 10x, so the check tells the two paths apart."""
    from kvserve.ops.fused_moe import fused_moe_triton

    x, q13, q2, weights, ids, s13, s2 = _fp8_case(tokens, experts, top_k, 64, 48, dtype)
    ref = fused_moe_torch(x, q13, q2, weights, ids, s13, s2, quantize_activations=True)
    rows = _count_quantized_rows(monkeypatch)
    out = fused_moe_triton(x, q13, q2, weights, ids, s13, s2, quantize_activations=True)
    assert out.dtype == dtype and rows == [tokens]
    assert _rel_err(out, ref) < W8A8_TOL[dtype]
    assert _rel_err(fused_moe_torch(x, q13, q2, weights, ids, s13, s2), ref) > 10 * W8A8_TOL[dtype]


@needs_interpreter
@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_triton_fused_moe_w8a8_with_biases_clamped_swiglu_and_expert_parallel_equals_reference(tokens, monkeypatch):
    """gpt-oss's activation (torch ops, then one quantization pass over the pairs' rows), biases, and two
    expert-parallel ranks whose sum is the whole layer."""
    from kvserve.ops.fused_moe import fused_moe_triton

    x, q13, q2, weights, ids, s13, s2 = _fp8_case(tokens, 8, 2, 64, 32, torch.float32)
    extras = _gpt_oss_extras(8, 64, 32)
    ref = fused_moe_torch(x, q13, q2, weights, ids, s13, s2, quantize_activations=True, **extras)
    rows = _count_quantized_rows(monkeypatch)
    out = fused_moe_triton(x, q13, q2, weights, ids, s13, s2, quantize_activations=True, **extras)
    assert rows == [tokens, tokens * 2]
    assert _rel_err(out, ref) < W8A8_TOL[torch.float32]
    both = _two_expert_parallel_ranks(x, q13, q2, weights, ids, extras, scales=(s13, s2), quantize_activations=True)
    assert _rel_err(both, ref) < W8A8_TOL[torch.float32]


@pytest.mark.skipif(INTERPRETED, reason="pure torch: runs once, in the parent run")
def test_w8a8_reference_quantizes_each_gemms_input_per_row():
    """The reference's W8A8 math, spelled out for one expert: x's rows and the activated rows quantized to e4m3
    (max |row| / 448), dequantized, multiplied by the dequantized weights in fp32."""
    from kvserve.ops.fp8_e4m3 import quantize_per_token

    x, q13, q2, weights, ids, s13, s2 = _fp8_case(5, 1, 1, 32, 16, torch.float32)
    dq = lambda t: (lambda q, s: q.float() * s)(*quantize_per_token(t))  # noqa: E731
    gate_up = dq(x) @ (q13[0].float() * s13[0][:, None]).T
    hidden = torch.nn.functional.silu(gate_up[:, :16]) * gate_up[:, 16:]
    want = (dq(hidden) @ (q2[0].float() * s2[0][:, None]).T) * weights
    got = fused_moe_torch(x, q13, q2, weights, ids, s13, s2, quantize_activations=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="fp8 experts"):
        fused_moe_torch(x, q13.float(), q2.float(), weights, ids, quantize_activations=True)


@pytest.mark.skipif(INTERPRETED, reason="pure torch: runs once, in the parent run")
def test_fp8_moe_path_table_covers_every_token_count_in_order():
    from kvserve.model.quantization.fp8_moe import FP8_MOE_PATHS, fp8_moe_path

    bounds = [p.max_tokens for p in FP8_MOE_PATHS]
    assert bounds == sorted(set(bounds)) and bounds[-1] >= 1 << 62
    assert {p.kernel for p in FP8_MOE_PATHS} <= {"w8a16", "w8a8"}
    for tokens in (1, *bounds[:-1], *(b + 1 for b in bounds[:-1])):
        assert fp8_moe_path(tokens) == next(p for p in FP8_MOE_PATHS if tokens <= p.max_tokens)


@pytest.mark.skipif(INTERPRETED, reason="pure torch: runs once, in the parent run")
def test_fp8_experts_quantize_activations_above_the_threshold_where_there_is_an_fp8_dot(monkeypatch):
    """Fp8MoEMethod (on the torch path here): steps of up to the table's weight-only bound give the weight-only
    result, larger ones the W8A8 result; with no fp8 dot (the plain CPU path, GPUs older than Ada) always
    weight-only."""
    from kvserve.model.moe import FusedMoE
    from kvserve.model.quantization import fp8_moe

    monkeypatch.setattr(fp8_moe, "FP8_MOE_PATHS", (fp8_moe.Fp8MoEPath(4, "w8a16"),
                                                   fp8_moe.Fp8MoEPath(1 << 62, "w8a8")))
    layer = FusedMoE(num_experts=8, hidden=64, intermediate=32, quant_method=fp8_moe.Fp8MoEMethod())
    _, w13, w2, _, _ = _case(1, 8, 2, 64, 32, torch.float32)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.fp8_dot is False  # CPU, no interpreter: the weight-only reference, as the dense FP8 layers
    fp8 = (layer.w13_weight, layer.w2_weight)
    scales = (layer.w13_weight_scale, layer.w2_weight_scale)
    for fp8_dot in (False, True):
        layer.fp8_dot = fp8_dot
        for tokens in (4, 5):
            x, _, _, weights, ids = _case(tokens, 8, 2, 64, 32, torch.float32, seed=tokens)
            w8a8 = fp8_dot and tokens > 4
            want = fused_moe_torch(x, *fp8, weights, ids, *scales, quantize_activations=w8a8)
            other = fused_moe_torch(x, *fp8, weights, ids, *scales, quantize_activations=not w8a8)
            got = layer(x, weights, ids)
            assert torch.equal(got, want) and not torch.equal(got, other), (fp8_dot, tokens)


def _gpt_oss_extras(experts, hidden, inter, seed=1):
    from kvserve.ops.fused_moe import ExpertActivation

    g = torch.Generator().manual_seed(seed)
    return dict(w13_bias=torch.randn(experts, 2 * inter, generator=g),
                w2_bias=torch.randn(experts, hidden, generator=g),
                activation=ExpertActivation("swiglu_oai", alpha=1.702, limit=0.8))


@pytest.mark.skipif(INTERPRETED, reason="pure torch: runs once, in the parent run")
def test_torch_reference_with_biases_and_clamped_swiglu_is_hf_gpt_oss_experts():
    """The reference's gpt-oss options against HF's own GptOssExperts (interleaved gate/up, [E, in, out])."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    x, w13, w2, weights, ids = _case(17, 8, 2, 32, 24, torch.float32)
    extras = _gpt_oss_extras(8, 32, 24)
    hf = GptOssExperts(transformers.GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=8,
                                                 swiglu_limit=0.8))
    with torch.no_grad():
        interleaved = torch.stack([w13[:, :24], w13[:, 24:]], dim=2).reshape(8, 48, 32)  # gate, up, gate, ...
        hf.gate_up_proj.copy_(interleaved.transpose(1, 2))
        bias = extras["w13_bias"]
        hf.gate_up_proj_bias.copy_(torch.stack([bias[:, :24], bias[:, 24:]], 2).reshape(8, 48))
        hf.down_proj.copy_(w2.transpose(1, 2))
        hf.down_proj_bias.copy_(extras["w2_bias"])
        expected = hf(x, ids, weights)
    torch.testing.assert_close(fused_moe_torch(x, w13, w2, weights, ids, **extras), expected, atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("tokens", [3, 70])
def test_triton_fused_moe_with_biases_and_clamped_swiglu_equals_torch_reference(tokens):
    from kvserve.ops.fused_moe import fused_moe_triton

    x, w13, w2, weights, ids = _case(tokens, 8, 2, 64, 32, torch.float32)
    extras = _gpt_oss_extras(8, 64, 32)
    ref = fused_moe_torch(x, w13, w2, weights, ids, **extras)
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, weights, ids, **extras), ref, atol=1e-5, rtol=1e-5)
    # Expert parallel: each rank adds the biases of its own experts only.
    both = _two_expert_parallel_ranks(x, w13, w2, weights, ids, extras)
    torch.testing.assert_close(both, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 7, 64, 512, 4096])
@pytest.mark.parametrize("experts,top_k,hidden,inter", [(128, 8, 2048, 768), (8, 2, 1024, 1792)])
def test_triton_fused_moe_on_gpu_equals_torch_reference(tokens, experts, top_k, hidden, inter):
    from kvserve.ops.fused_moe import fused_moe_triton

    x, w13, w2, weights, ids = (t.cuda() for t in _case(tokens, experts, top_k, hidden, inter, torch.bfloat16))
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
    out = fused_moe_triton(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 7, 64, 512, 4096])
@pytest.mark.parametrize("experts,top_k,hidden,inter", [(128, 8, 2048, 768), (8, 2, 1024, 1792)])
@pytest.mark.parametrize("quantize_activations", [False, True], ids=["w8a16", "w8a8"])
def test_triton_fused_moe_fp8_on_gpu_equals_torch_reference(tokens, experts, top_k, hidden, inter,
                                                            quantize_activations):
    """bf16 activations, fp8 experts, both paths (bf16 W8A8 only here: the interpreter truncates bf16). The
    W8A8 reference takes bf16 x and rounds gate_up to bf16 where the kernel stores it."""
    from kvserve.ops.fused_moe import fused_moe_triton

    x, q13, q2, weights, ids, s13, s2 = (t.cuda() for t in _fp8_case(tokens, experts, top_k, hidden, inter,
                                                                       torch.bfloat16))
    ref = fused_moe_torch(x if quantize_activations else x.float(), q13, q2, weights, ids, s13, s2,
                          quantize_activations=quantize_activations)
    out = fused_moe_triton(x, q13, q2, weights, ids, s13, s2, quantize_activations=quantize_activations)
    if quantize_activations:
        # Where the kernel's fp32 sums round gate_up to the other side of a bf16 step than torch's, an e4m3 step
        # of the down projection's input (and, at a row's amax, the row's scale) can flip too: sparse errors a
        # few percent of the row, so the bound is on the whole output's norm, not its largest element.
        assert _norm_rel_err(out, ref) < 1e-2
    else:
        assert _rel_err(out, ref) < 2e-2


def _option_tiles(per_pair: bool, block_m: int, swap_ab: bool, fast_accum: bool):
    """A small tile configuration with the SWAP_AB / FAST_ACCUM options as given, in both GEMMs."""
    from kvserve.ops.fused_moe import _tiles

    return _tiles(per_pair, block_m, 64, 32, 1, 4, 2, swap_ab=swap_ab, fast_accum=fast_accum)


@needs_interpreter
@pytest.mark.parametrize("per_pair,tokens", [(True, 2), (False, 13)], ids=["per-pair", "sorted"])
@pytest.mark.parametrize("kind", ["fp32", "fp8", "fp8_w8a8"])
@pytest.mark.parametrize("swap_ab,fast_accum", [(True, False), (True, True), (False, True)],
                         ids=["swapped", "swapped-fast-accum", "fast-accum"])
def test_triton_fused_moe_swapped_product_equals_reference(per_pair, tokens, kind, swap_ab, fast_accum,
                                                            monkeypatch):
    """SWAP_AB computes C^T = B A^T, FAST_ACCUM accumulates inside the dot: the same sums (exact in the
    interpreter), so the same results as the reference, for both row layouts, 16/32-bit and fp8 experts,
    weight-only and W8A8."""
    from kvserve.ops import fused_moe

    cfg = _option_tiles(per_pair, 16, swap_ab, fast_accum)
    monkeypatch.setattr(fused_moe, "_gemm_config", lambda *a, **k: cfg)
    if kind == "fp32":
        x, w13, w2, weights, ids = _case(tokens, 8, 2, 64, 48, torch.float32)
        ref = fused_moe_torch(x, w13, w2, weights, ids)
        out = fused_moe.fused_moe_triton(x, w13, w2, weights, ids)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    w8a8 = kind == "fp8_w8a8"
    x, q13, q2, weights, ids, s13, s2 = _fp8_case(tokens, 8, 2, 64, 48, torch.float32)
    if w8a8 and swap_ab:  # the transposed product takes 16-bit operands only (wrong sums compiled for sm_90)
        with pytest.raises(ValueError, match="SWAP_AB tiles take 16-bit operands only"):
            fused_moe.fused_moe_triton(x, q13, q2, weights, ids, s13, s2, quantize_activations=True)
        return
    ref = fused_moe_torch(x, q13, q2, weights, ids, s13, s2, quantize_activations=w8a8)
    out = fused_moe.fused_moe_triton(x, q13, q2, weights, ids, s13, s2, quantize_activations=w8a8)
    assert _rel_err(out, ref) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,block_m", [(1, 16), (256, 32)], ids=["per-pair", "sorted"])
@pytest.mark.parametrize("kind,swap_ab,fast_accum", [("bf16", True, False), ("bf16", True, True),
                                                     ("bf16", False, True), ("fp8_w8a8", False, True)],
                         ids=["swapped-bf16", "swapped-fast-accum-bf16", "fast-accum-bf16", "fast-accum-fp8_w8a8"])
def test_triton_fused_moe_swapped_product_on_gpu_equals_reference(tokens, block_m, kind, swap_ab, fast_accum,
                                                                   monkeypatch):
    """The transposed product compiled (Hopper's warpgroup MMA with the weight tile on its tall side; 16-bit
    operands: with e4m3 ones it gave wrong sums on the H200), and the accumulation inside the dot (for fp8: the tensor cores' reduced-precision accumulator over the whole K,
    still within the W8A8 bound), at the Qwen3-30B-A3B expert shape."""
    from kvserve.ops import fused_moe

    cfg = _option_tiles(tokens == 1, block_m, swap_ab, fast_accum)
    monkeypatch.setattr(fused_moe, "_gemm_config", lambda *a, **k: cfg)
    if kind == "bf16":
        x, w13, w2, weights, ids = (t.cuda() for t in _case(tokens, 128, 8, 2048, 768, torch.bfloat16))
        ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
        out = fused_moe.fused_moe_triton(x, w13, w2, weights, ids)
        assert _rel_err(out, ref) < 2e-2
        return
    x, q13, q2, weights, ids, s13, s2 = (t.cuda() for t in _fp8_case(tokens, 128, 8, 2048, 768, torch.bfloat16))
    ref = fused_moe_torch(x, q13, q2, weights, ids, s13, s2, quantize_activations=True)
    out = fused_moe.fused_moe_triton(x, q13, q2, weights, ids, s13, s2, quantize_activations=True)
    assert _norm_rel_err(out, ref) < 1e-2



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_triton_fused_moe_gpt_oss_shapes_on_gpu_equal_torch_reference(tokens):
    """gpt-oss-20b's expert shapes (32 experts, top-4, 2880 wide) with biases and the clamped SwiGLU, bf16."""
    from kvserve.ops.fused_moe import fused_moe_triton

    x, w13, w2, weights, ids = (t.cuda() for t in _case(tokens, 32, 4, 2880, 2880, torch.bfloat16))
    extras = {k: (v.cuda() * 0.1).to(torch.bfloat16) if isinstance(v, torch.Tensor) else v
              for k, v in _gpt_oss_extras(32, 2880, 2880).items()}
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids,
                          **{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in extras.items()})
    out = fused_moe_triton(x, w13, w2, weights, ids, **extras)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def _mxfp4_case(tokens, experts, top_k, hidden, inter, dtype, seed=0):
    """_case with MXFP4 experts (random E2M1 bytes; E8M0 scales around 2^-6, a few groups at 2^-1 and 2^-12):
    (x, w13 uint8 [E, 2I, H/2], w2 uint8 [E, H, I/2], weights, ids, w13 scales [E, 2I, H/32], w2 scales)."""
    x, _, _, weights, ids = _case(tokens, experts, top_k, hidden, inter, dtype, seed)
    g = torch.Generator().manual_seed(seed + 100)

    def packed(rows, inputs):
        blocks = torch.randint(0, 256, (experts, rows, inputs // 2), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 124, (experts, rows, inputs // 32), dtype=torch.uint8, generator=g)
        scales.view(-1)[::17] = 126
        scales.view(-1)[5::23] = 115
        return blocks, scales

    (b13, s13), (b2, s2) = packed(2 * inter, hidden), packed(hidden, inter)
    return x, b13, b2, weights, ids, s13, s2


@pytest.mark.skipif(INTERPRETED, reason="pure torch: runs once, in the parent run")
def test_mxfp4_reference_dequantizes_as_hf_transformers():
    """kvserve's MXFP4 reading (packed bytes [N, K / 2]) against transformers' own (its [N, K / 32, 16] blocks)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kvserve.ops.mxfp4 import dequantize_mxfp4

    _, b13, _, _, _, s13, _ = _mxfp4_case(1, 4, 2, 64, 32, torch.float32)
    hf = convert_moe_packed_tensors(b13.unflatten(-1, (-1, 16)), s13, dtype=torch.float32)  # [E, K, N]
    torch.testing.assert_close(dequantize_mxfp4(b13, s13, torch.float32), hf.transpose(1, 2), atol=0, rtol=0)
    with pytest.raises(ValueError, match="quantize_activations needs fp8 experts"):
        x, b13, b2, weights, ids, s13, s2 = _mxfp4_case(3, 8, 2, 64, 32, torch.float32)
        fused_moe_torch(x, b13, b2, weights, ids, s13, s2, quantize_activations=True)


@needs_interpreter
@pytest.mark.parametrize("tokens,experts,top_k,hidden", [(1, 8, 2, 64), (13, 8, 2, 96), (70, 8, 2, 64),
                                                          (300, 8, 2, 64), (9, 16, 4, 96)])
def test_triton_fused_moe_mxfp4_equals_dequantized_reference(tokens, experts, top_k, hidden):
    """Every tile configuration (one block per pair, then sorted); a hidden size of 96 leaves a partial K tile."""
    from kvserve.ops.fused_moe import fused_moe_triton
    from kvserve.ops.mxfp4 import dequantize_mxfp4

    x, b13, b2, weights, ids, s13, s2 = _mxfp4_case(tokens, experts, top_k, hidden, 64, torch.float32)
    dequantized = dequantize_mxfp4(b13, s13, torch.float32), dequantize_mxfp4(b2, s2, torch.float32)
    ref = fused_moe_torch(x, *dequantized, weights, ids)
    torch.testing.assert_close(fused_moe_torch(x, b13, b2, weights, ids, s13, s2), ref, atol=0, rtol=0)
    out = fused_moe_triton(x, b13, b2, weights, ids, s13, s2)
    assert _rel_err(out, ref) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("tokens", [3, 70])
def test_triton_fused_moe_mxfp4_with_biases_clamped_swiglu_and_expert_parallel_equals_reference(tokens):
    """gpt-oss's experts as its checkpoints hold them: MXFP4, biases, the clamped SwiGLU; two expert-parallel
    ranks sum to the whole layer."""
    from kvserve.ops.fused_moe import fused_moe_triton

    x, b13, b2, weights, ids, s13, s2 = _mxfp4_case(tokens, 8, 2, 64, 32, torch.float32)
    extras = _gpt_oss_extras(8, 64, 32)
    ref = fused_moe_torch(x, b13, b2, weights, ids, s13, s2, **extras)
    assert _rel_err(fused_moe_triton(x, b13, b2, weights, ids, s13, s2, **extras), ref) < 1e-5
    both = _two_expert_parallel_ranks(x, b13, b2, weights, ids, extras, scales=(s13, s2))
    assert _rel_err(both, ref) < 1e-5


@needs_interpreter
def test_mxfp4_refuses_tiles_it_cannot_decode(monkeypatch):
    from kvserve.ops import fused_moe

    x, b13, b2, weights, ids, s13, s2 = _mxfp4_case(13, 8, 2, 64, 32, torch.float32)
    monkeypatch.setattr(fused_moe, "_gemm_config", lambda *a, **k: _option_tiles(False, 16, True, False))
    with pytest.raises(ValueError, match="MXFP4 experts take"):
        fused_moe.fused_moe_triton(x, b13, b2, weights, ids, s13, s2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 7, 64, 2048])
@pytest.mark.parametrize("experts,top_k,hidden,inter", [(32, 4, 2880, 2880), (128, 4, 2880, 2880)])
def test_triton_fused_moe_mxfp4_on_gpu_equals_dequantized_reference(tokens, experts, top_k, hidden, inter):
    """gpt-oss-20b's and -120b's expert shapes, MXFP4 as their checkpoints store them, bf16 activations, with
    biases and the clamped SwiGLU: the bf16 decode of each tile is exact, so the bound is bf16's."""
    from kvserve.ops.fused_moe import fused_moe_triton
    from kvserve.ops.mxfp4 import dequantize_mxfp4

    x, b13, b2, weights, ids, s13, s2 = (t.cuda() for t in _mxfp4_case(tokens, experts, top_k, hidden, inter,
                                                                         torch.bfloat16))
    extras = {k: (v.cuda() * 0.1).to(torch.bfloat16) if isinstance(v, torch.Tensor) else v
              for k, v in _gpt_oss_extras(experts, hidden, inter).items()}
    ref = fused_moe_torch(x.float(), dequantize_mxfp4(b13, s13, torch.float32),
                          dequantize_mxfp4(b2, s2, torch.float32), weights, ids,
                          **{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in extras.items()})
    out = fused_moe_triton(x, b13, b2, weights, ids, s13, s2, **extras)
    assert _rel_err(out, ref) < 2e-2
