"""Quantized checkpoints (AWQ, GPTQ, FP8, compressed-tensors) and --quantization fp8: kvserve's greedy
tokens on CPU (fp32, the dequantize-then-matmul reference path) equal HF transformers' on the
DEQUANTIZED weights, written by our reference quantizers (tests/quant_utils.py) as a plain HF checkpoint.
Plus: weight memory in real bytes, and clear errors for what is not supported."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.loader import weight_bytes
from tests.conftest import hf_greedy, random_prompts
from tests.quant_utils import make_quantized_pair, quantize_tensors, write_checkpoint

MAX_TOKENS = 12

CASES = [
    ("llama", "awq", {"group_size": 32}),
    ("qwen2", "awq", {"group_size": 64}),  # qkv bias, tied embeddings
    ("llama", "gptq", {"bits": 4, "group_size": 32, "sym": True, "desc_act": True}),
    ("mistral", "gptq", {"bits": 4, "group_size": 64, "sym": False, "desc_act": False}),
    ("llama", "gptq", {"bits": 8, "group_size": -1, "sym": False, "desc_act": True}),
    ("llama", "fp8", {}),
    ("qwen3", "compressed-tensors", {"per_channel": True}),
    ("llama", "compressed-tensors", {"per_channel": False}),
]


@pytest.fixture(scope="module")
def quantized(tiny_model_factory, tmp_path_factory):
    cache = {}

    def make(arch, method, **opt):
        key = (arch, method, tuple(sorted(opt.items())))
        if key not in cache:
            src, _ = tiny_model_factory(arch)
            cache[key] = make_quantized_pair(Path(src), tmp_path_factory.mktemp(f"{arch}-{method}"), method, **opt)
        return cache[key]

    return make


def _greedy(llm_path, prompts, **kw):
    llm = LLM(str(llm_path), max_model_len=256, kv_cache_memory_bytes=8 << 20, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch,method,opt", CASES, ids=[f"{a}-{m}-{'-'.join(f'{k}{v}' for k, v in o.items())}"
                                                        for a, m, o in CASES])
def test_quantized_checkpoint_matches_hf_on_dequantized_weights(quantized, arch, method, opt):
    import transformers

    qdir, ddir = quantized(arch, method, **opt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    prompts = random_prompts(4, 1, 60, seed=len(method) + len(arch))
    llm, got = _greedy(qdir, prompts)
    assert got == hf_greedy(hf, prompts, MAX_TOKENS)
    # The checkpoint format was detected from config.json and the layers really are quantized.
    model = llm.llm_engine.executor.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert type(qkv.quant_method).__name__ != "UnquantizedLinearMethod"
    assert model.lm_head.weight.dtype == torch.float32  # the head (and embedding) stay unquantized


def test_online_fp8_matches_hf_on_per_channel_fp8_weights(tiny_model_factory, tmp_path):
    """--quantization fp8 on a float checkpoint: per-channel e4m3 weights made at load."""
    import transformers
    from safetensors.torch import load_file

    src, _ = tiny_model_factory("llama")
    weights = load_file(str(Path(src) / "model.safetensors"))
    _, deq = quantize_tensors(weights, "compressed-tensors", per_channel=True)
    config = json.loads((Path(src) / "config.json").read_text())
    ddir = write_checkpoint(tmp_path / "dq", config, deq, tokenizer_from=Path(src))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    prompts = random_prompts(4, 1, 60, seed=5)
    llm, got = _greedy(src, prompts, quantization="fp8")
    assert llm.llm_engine.executor.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert got == hf_greedy(hf, prompts, MAX_TOKENS)


def test_weight_memory_is_counted_in_real_bytes(quantized, tiny_model_factory, caplog):
    src, _ = tiny_model_factory("llama")
    qdir, _ = quantized("llama", "awq", group_size=32)
    with caplog.at_level(logging.INFO, logger="kvserve.worker.worker"):
        plain = LLM(src, max_model_len=256, kv_cache_memory_bytes=8 << 20)
        awq = LLM(str(qdir), max_model_len=256, kv_cache_memory_bytes=8 << 20)
    def linear_bytes(llm):
        return sum(weight_bytes(m) for n, m in llm.llm_engine.executor.runner.model.named_modules() if n.endswith("_proj"))
    # fp32 plain vs 4-bit values + fp32 scales/zeros per 32 weights: 4 / (0.5 + 8/32) = 5.33x fewer bytes.
    ratio = linear_bytes(plain) / linear_bytes(awq)
    assert 5.2 < ratio < 5.5, ratio
    assert awq.llm_engine.executor.worker.weights_bytes == weight_bytes(awq.llm_engine.executor.runner.model)
    assert any("model weights take" in r.getMessage() and "quantization: awq" in r.getMessage() for r in caplog.records)


# ---- errors ----------------------------------------------------------------------------------------
def _with_quant_config(src: Path, dst: Path, qcfg: dict) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("qcfg,message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"gptq: bits 3 is not supported \(supported: 4, 8\)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 256}, r"gptq: group_size 256 is not supported \(supported: -1, 32, 64, 128\)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 1024, "version": "gemm", "zero_point": True},
     r"awq: group_size .*1024 is not supported \(supported: 32, 64, 128\)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv", "zero_point": True},
     r"awq: version 'gemv' is not supported \(supported: gemm\)"),
    ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes'.*supported: awq, gptq, fp8, compressed-tensors"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\] is not \[rows, columns\]"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     r"compressed-tensors: format 'pack-quantized' is not supported"),
])
def test_unsupported_checkpoint_quantization_is_rejected(tiny_model_factory, tmp_path, qcfg, message):
    src, _ = tiny_model_factory("llama")
    path = _with_quant_config(Path(src), tmp_path / "m", qcfg)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), max_model_len=256, kv_cache_memory_bytes=8 << 20)


def test_quantization_flag_is_checked(tiny_model_factory, quantized):
    src, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match=r"--quantization: 'int3' is not supported \(supported: awq, gptq, fp8"):
        LLM(src, quantization="int3")
    with pytest.raises(ValueError, match=r"--quantization awq: this checkpoint is not quantized"):
        LLM(src, quantization="awq", max_model_len=256, kv_cache_memory_bytes=8 << 20)
    qdir, _ = quantized("llama", "awq", group_size=32)
    with pytest.raises(ValueError, match=r"--quantization gptq: the checkpoint is quantized with 'awq'"):
        LLM(str(qdir), quantization="gptq", max_model_len=256, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match=r"--quantization gptq: GGUF checkpoints are dequantized at load"):
        LLM(quantization="gptq")  # the embedded SmolLM2 GGUF
    # The vLLM alias names the same format.
    LLM(str(qdir), quantization="awq_marlin", max_model_len=256, kv_cache_memory_bytes=8 << 20)


def test_corrupt_qweight_shape_is_rejected(quantized, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    qdir, _ = quantized("llama", "awq", group_size=32)
    bad = tmp_path / "bad"
    shutil.copytree(qdir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.qweight"
    tensors[name] = tensors[name][:, :-1].contiguous()  # one packed column short
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj\.qweight: weight: checkpoint shape \(128, 7\) does "
                                         r"not match parameter \(128, 8\); expected layout awq qweight: int32 \[in, out/8\]"):
        LLM(str(bad), max_model_len=256, kv_cache_memory_bytes=8 << 20)
    tensors = load_file(str(qdir / "model.safetensors"))
    tensors[name] = tensors[name].float()  # a cast checkpoint: packed values destroyed
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj\.qweight: weight: checkpoint tensor has dtype torch.float32, but the layer's "
                                         r"quantization method expects torch.int32"):
        LLM(str(bad), max_model_len=256, kv_cache_memory_bytes=8 << 20)


@pytest.mark.parametrize("method,opt", [("awq", {"group_size": 32}),
                                        ("gptq", {"bits": 4, "group_size": 32, "sym": False, "desc_act": True})])
def test_quantized_checkpoint_with_tensor_parallelism(quantized, method, opt):
    """TP=2 (two CPU processes): packed tensors, scales and act-order g_idx are cut per rank by the
    layers' loaders; same greedy tokens as one process."""
    qdir, _ = quantized("llama", method, **opt)
    prompts = random_prompts(3, 5, 40, seed=11)
    _, single = _greedy(qdir, prompts)
    _, tp2 = _greedy(qdir, prompts, tensor_parallel_size=2)
    assert tp2 == single
