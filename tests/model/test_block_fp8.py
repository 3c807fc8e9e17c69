"""Block-wise FP8 checkpoints (weight_block_size) served as stored: the dense layers keep the checkpoint's e4m3
bytes and block scales (quantization/fp8_block.py), and give HF's greedy tokens on the dequantized weights, on
the CPU path, under Triton's interpreter (the W8A16 kernel with group scales at decode, the dequantize kernel
before cuBLAS above), and with tensor parallelism whose row slices start inside a block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompts

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def block_fp8(tiny_model_factory, tmp_path_factory):
    """(arch, block) -> (block-wise FP8 checkpoint, its dequantized fp32 twin, HF on the twin)."""
    import transformers

    from tests.quant_utils import write_block_fp8_pair

    cache = {}

    def make(arch: str, block: tuple[int, int]):
        if (arch, block) not in cache:
            src, _ = tiny_model_factory(arch)
            qdir, ddir = write_block_fp8_pair(Path(src), tmp_path_factory.mktemp(f"{arch}-{block[0]}x{block[1]}"),
                                              block, scales_apart=arch == "qwen3")
            hf = transformers.AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
            cache[arch, block] = qdir, ddir, hf
        return cache[arch, block]

    return make


def _generate(path, prompts, **kwargs):
    llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=8 << 20, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dense_layers_keep_the_checkpoint_bytes_and_match_hf(block_fp8, arch, capsys):
    """Blocks of 16 x 24 (ragged at the edges, and k/v parts of 32 rows end inside one): every projection
    is e4m3 in memory, holding the checkpoint's bytes; the plan counts what the engine holds."""
    from safetensors.torch import load_file

    from kvserve.entrypoints.cli import main as cli_main

    qdir, _, hf = block_fp8(arch, (16, 24))
    prompts = random_prompts(4, 1, 60, seed=3)
    llm, got = _generate(qdir, prompts)
    assert got == hf_greedy(hf, prompts, MAX_TOKENS)
    stored = {}
    for shard in sorted(qdir.glob("*.safetensors")):
        stored.update(load_file(str(shard)))
    model = llm.llm_engine.executor.runner.model
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert linear.weight.dtype == torch.float8_e4m3fn
    qkv = model.layers[0].self_attn.qkv_proj
    parts = [stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat(parts).view(torch.uint8))
    served = llm.llm_engine.executor.worker.weights_bytes
    llm.llm_engine.shutdown()
    assert cli_main(["plan", str(qdir), "--max-model-len", "256", "--gpu", "H100", "--dtype", "float32", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert abs(plan["ranks"][0]["weights"] - served) < 0.01 * served  # the rotary table apart


def test_a_float_layer_in_a_block_fp8_checkpoint_is_quantized_as_read(block_fp8, tmp_path):
    """A layer the quantizing tool left in float (its weight stored without a scale): quantized block by block
    as it is read, the same blocks the tool would have made, so every layer has one layout."""
    import shutil

    from safetensors.torch import load_file, save_file

    qdir, ddir, hf = block_fp8("llama", (16, 24))
    mixed = tmp_path / "mixed"
    shutil.copytree(qdir, mixed)
    (shard,) = mixed.glob("*.safetensors")
    tensors = load_file(str(shard))
    name = "model.layers.1.mlp.down_proj.weight"
    del tensors[name + "_scale_inv"]
    tensors[name] = load_file(str(Path(ddir) / "model.safetensors"))[name]  # the float weight itself
    save_file(tensors, str(shard), metadata={"format": "pt"})
    prompts = random_prompts(3, 1, 40, seed=4)
    llm, got = _generate(mixed, prompts)
    assert llm.llm_engine.executor.runner.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert got == hf_greedy(hf, prompts, MAX_TOKENS)


def test_tensor_parallel_slices_starting_inside_a_block_match_tp1(block_fp8):
    """TP=2 with 24-row blocks: rank 1's q rows start at row 32, inside the second block, and its k/v rows at 16;
    each rank reads the scale rows its slices touch."""
    qdir, _, hf = block_fp8("llama", (24, 16))
    prompts = random_prompts(3, 5, 40, seed=11)
    _, single = _generate(qdir, prompts)
    llm, tp2 = _generate(qdir, prompts, tensor_parallel_size=2)
    llm.llm_engine.shutdown()
    assert tp2 == single == hf_greedy(hf, prompts, MAX_TOKENS)


def test_pipeline_stages_and_ignored_layers(block_fp8, tmp_path):
    """PP=2: each stage loads its own layers in FP8 and passes over the other's. A layer the config lists in
    ignored_layers (stored in FP8 anyway) is served unquantized, dequantized as read."""
    import shutil

    qdir, _, hf = block_fp8("qwen3", (16, 24))
    prompts = random_prompts(3, 5, 40, seed=12)
    expected = hf_greedy(hf, prompts, MAX_TOKENS)
    llm, pp2 = _generate(qdir, prompts, pipeline_parallel_size=2)
    llm.llm_engine.shutdown()
    assert pp2 == expected
    ignored = tmp_path / "ignored"
    shutil.copytree(qdir, ignored)
    config = json.loads((ignored / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = ["model.layers.0.mlp.down_proj"]
    (ignored / "config.json").write_text(json.dumps(config))
    llm, got = _generate(ignored, prompts)
    layers = llm.llm_engine.executor.runner.model.layers
    assert layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert got == expected


def test_an_input_slice_starting_inside_a_block_is_refused(block_fp8):
    qdir, _, _ = block_fp8("llama", (16, 24))
    with pytest.raises(Exception, match=r"start at feature 32, inside a 24-wide block"):
        LLM(str(qdir), max_model_len=256, kv_cache_memory_bytes=8 << 20, tensor_parallel_size=2)


_TRITON_SCRIPT = r"""
import json, sys
from kvserve import LLM, SamplingParams
path, prompts, max_tokens = json.loads(sys.stdin.read())
llm = LLM(path, attention_backend="triton", max_model_len=256, kv_cache_memory_bytes=8 << 20)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_triton_kernels_in_the_engine_match_hf(block_fp8):
    """Under Triton's interpreter the layers take the GPU's paths: the dequantize kernel for the prompts'
    rows, the W8A16 kernel with group scales for the decode steps."""
    from tests.triton_interpreter import interpreter_unusable

    if (why := interpreter_unusable()) is not None:
        pytest.skip(why)
    qdir, _, hf = block_fp8("llama", (16, 24))
    prompts = random_prompts(2, 20, 40, seed=6)
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], input=json.dumps([str(qdir), prompts, MAX_TOKENS]),
                          capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"},
                          cwd=Path(__file__).resolve().parents[2], timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == hf_greedy(hf, prompts, MAX_TOKENS)
