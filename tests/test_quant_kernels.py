"""Triton kernels of quantization against their torch references, on the CPU through Triton's
interpreter (a subprocess with TRITON_INTERPRET=1, as in test_triton_attention.py: the variable must be
set before triton is imported): the int4/int8 kernels for AWQ and GPTQ layouts (the fused
dequantize-GEMM, the split-K skinny decode kernel, the dequantize kernel of the prefill path, and the
dispatch by M), and the FP8 KV cache write/read in the Triton attention backend."""

from __future__ import annotations

import os

import pytest
import torch

from tests.triton_interpreter import run_file_in_interpreter

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                       reason="runs in the interpreter subprocess")


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
def test_quant_kernels_in_interpreter_subprocess():
    out = run_file_in_interpreter(__file__)
    assert " passed" in out, out[-3000:]


def _layer(method: str, k: int, n: int, **opt):
    """A layer in the served layout, made from random weights by the reference quantizers and loaded
    through the method's own create/load/process path."""
    from torch import nn

    from kvserve.model.quantization import AWQConfig, GPTQConfig
    from tests.quant_utils import quantize_tensors

    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    tensors, _ = quantize_tensors({"model.layers.0.mlp.down_proj.weight": w}, method, **opt)
    if method == "awq":
        cfg = AWQConfig(4, opt["group_size"], True, "gemm", [])
    else:
        cfg = GPTQConfig(opt["bits"], opt["group_size"], opt.get("desc_act", False), opt.get("sym", True), "gptq")
    layer = nn.Module()
    method_obj = cfg.get_quant_method("layers.0.mlp.down_proj")
    method_obj.create_weights(layer, k, [n], k, n, torch.float32)
    for name, t in tensors.items():
        getattr(layer, name.rsplit(".", 1)[1]).data.copy_(t)
    method_obj.process_weights_after_loading(layer)
    return layer


KERNEL_CASES = [
    ("awq", {"group_size": 32}),
    ("awq", {"group_size": 64}),
    ("awq", {"group_size": 128}),
    ("gptq", {"bits": 4, "group_size": 32, "desc_act": True, "sym": False}),
    ("gptq", {"bits": 4, "group_size": 128, "desc_act": False, "sym": True}),
    ("gptq", {"bits": 8, "group_size": 64, "desc_act": True, "sym": True}),
]


@needs_interpreter
@pytest.mark.parametrize("method,opt", KERNEL_CASES, ids=[f"{m}-{'-'.join(f'{k}{v}' for k, v in o.items())}"
                                                          for m, o in KERNEL_CASES])
@pytest.mark.parametrize("rows", [3, 70])  # decode (split-K) and prefill tiles (with a ragged last tile)
def test_int_gemm_equals_reference(method, opt, rows):
    from kvserve.model.quantization.int_weights import IntWeights
    from kvserve.model.quantization.triton_int_gemm import int_gemm

    k, n = 256, 96  # n not a multiple of the N tile: masked columns
    layer = _layer(method, k, n, **opt)
    device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
    for p in layer.parameters():
        p.data = p.data.to(device)
    x = torch.randn(rows, k, device=device)
    reference = x @ IntWeights.dequantize(layer).float()
    got = int_gemm(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.quant_bits, layer.group_size)
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
    if rows <= 16:  # the split-K path and the single-split path agree
        single = int_gemm(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.quant_bits,
                          layer.group_size, split_k=1)
        torch.testing.assert_close(got, single, atol=1e-4, rtol=1e-4)


# Every int layout the new paths must handle: AWQ groups, GPTQ 4/8 bit, sym/asym, act-order or not.
INT_CASES = KERNEL_CASES + [
    ("gptq", {"bits": 4, "group_size": 64, "desc_act": True, "sym": True}),
    ("gptq", {"bits": 4, "group_size": 128, "desc_act": False, "sym": False}),
    ("gptq", {"bits": 8, "group_size": 128, "desc_act": False, "sym": False}),
    ("gptq", {"bits": 8, "group_size": 32, "desc_act": True, "sym": False}),
]
INT_IDS = [f"{m}-{'-'.join(f'{k}{v}' for k, v in o.items())}" for m, o in INT_CASES]


def _on_device(layer):
    device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
    for p in layer.parameters():
        p.data = p.data.to(device)
    return device


@needs_interpreter
@pytest.mark.parametrize("method,opt", INT_CASES, ids=INT_IDS)
def test_dequantize_kernel_equals_reference(method, opt):
    """The prefill path's dequantize kernel writes exactly IntWeights.dequantize's W (same fp32 ops)."""
    from kvserve.model.quantization.int_weights import IntWeights
    from kvserve.model.quantization.triton_int_dequant import dequantize_int

    layer = _layer(method, 384, 96, **opt)  # 3 K tiles of 128; 96 columns: a masked N tile
    _on_device(layer)
    reference = IntWeights.dequantize(layer).float()
    args = (layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.quant_bits, layer.group_size)
    assert torch.equal(dequantize_int(*args, torch.float32), reference)
    # bf16: one rounding of the same fp32 value (the interpreter truncates where the GPU rounds to nearest).
    torch.testing.assert_close(dequantize_int(*args, torch.bfloat16).float(), reference, atol=0, rtol=2**-7)


@needs_interpreter
@pytest.mark.parametrize("method,opt", INT_CASES, ids=INT_IDS)
@pytest.mark.parametrize("rows", [1, 5])  # the FMA (one row) and tl.dot variants
def test_skinny_split_k_equals_reference(method, opt, rows):
    """Every split count (1: direct store; several, with a ragged last split) gives the reference product,
    and the shared workspace and tile counters are left zero for the next call (CUDA-graph replays rely
    on it)."""
    from kvserve.model.quantization.int_weights import IntWeights
    from kvserve.model.quantization.triton_int_gemv import _workspaces, skinny_int_gemm

    k, n = (320 if opt["group_size"] <= 64 else 384), 96  # 320: a partial last K tile of 128
    layer = _layer(method, k, n, **opt)
    device = _on_device(layer)
    x = torch.randn(rows, k, device=device)
    reference = x @ IntWeights.dequantize(layer).float()
    pack = 32 // layer.quant_bits
    configs = [(64, 128, 4, 3), (32, 16 * pack, 2, 2)] if rows > 1 else [(128, 128, 4, 3), (32, 64, 2, 2)]
    for config in configs:
        for split in (1, 2, 3, 8):
            got = skinny_int_gemm(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.quant_bits,
                                  layer.group_size, split, config)
            torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4, msg=f"{config} split {split}")
            ws = _workspaces.get(x.device)
            if ws is not None:
                assert not ws[0].any() and not ws[1].any(), "workspace not left clean"


@needs_interpreter
@pytest.mark.parametrize("method,opt", [INT_CASES[2], INT_CASES[3], INT_CASES[5]], ids=[INT_IDS[2], INT_IDS[3],
                                                                                       INT_IDS[5]])
@pytest.mark.parametrize("rows", [1, 4, 16, 40, 256])  # skinny M=1, skinny dot, fused tiles, dequant + matmul
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int_matmul_dispatch(method, opt, rows, dtype):
    """The engine's entry point at every path it picks by M, against the reference dequantize-then-matmul
    in fp32; bf16 as served (scales, zeros and activations)."""
    from kvserve.model.quantization.int_matmul import DEQUANT_MIN_M, int_matmul
    from kvserve.model.quantization.int_weights import IntWeights

    if INTERPRETED and dtype == torch.bfloat16 and 1 < rows < DEQUANT_MIN_M:
        pytest.skip("the interpreter's tl.dot gives garbage for bf16 operands (the old kernel's too)")
    k, n = 256, 96
    layer = _layer(method, k, n, **opt)
    device = _on_device(layer)
    layer.scales.data = layer.scales.data.to(dtype)
    layer.zeros.data = layer.zeros.data.to(dtype)
    x = torch.randn(rows, k, device=device).to(dtype)
    reference = x.float() @ IntWeights.dequantize(layer).float()
    got = int_matmul(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.quant_bits, layer.group_size)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), reference, atol=tol, rtol=tol)


FP8_KV_CASES = [  # (context lengths, query lengths, forced split-KV): prefill with context, mixed, decode
    ([0, 21], [17, 5], None),
    ([40, 3, 0], [1, 1, 1], False),
    ([300, 90], [1, 1], True),
]


@needs_interpreter
@pytest.mark.parametrize("ctx_lens,q_lens,split", FP8_KV_CASES)
def test_fp8_kv_cache_triton_equals_torch_reference(ctx_lens, q_lens, split):
    """Both backends store the same e4m3 bytes and attend over the same dequantized K/V."""
    from kvserve.ops.attention_metadata import AttentionMetadata
    from kvserve.ops.torch_attention import TorchAttentionBackend, quantize_kv
    from kvserve.ops.triton_attention import TritonAttentionBackend
    from tests.test_triton_attention import make_batch

    q, k, v, kv_cache, meta = make_batch(ctx_lens, q_lens, seed=len(ctx_lens))
    device = q.device
    k_scale = torch.tensor([0.011], device=device)
    v_scale = torch.tensor([0.013], device=device)
    # The cached context: the full-precision cache's values quantized with the same scales.
    cache = torch.stack([quantize_kv(kv_cache[0], k_scale), quantize_kv(kv_cache[1], v_scale)])
    scale = q.shape[-1] ** -0.5
    ref_cache, tri_cache = cache.clone(), cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, scale, k_scale=k_scale, v_scale=v_scale)
    backend = TritonAttentionBackend(split_kv=split, num_splits=3 if split else None)
    out = backend.forward(q, k, v, tri_cache, meta, scale, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(tri_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # And the fp8 cache is a real approximation of the full-precision one (e4m3: 3 mantissa bits).
    full = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), AttentionMetadata(**meta.__dict__), scale)
    n = meta.num_actual_tokens
    assert (out[:n] - full[:n]).abs().max() < 0.15
