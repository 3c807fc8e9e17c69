"""benchmarks/write_random_checkpoint.py writes checkpoints that HF transformers and kvserve read alike: a tiny
Qwen3-MoE shape, bf16 and fp8 (per-tensor e4m3 projections, bf16 routers), greedy tokens identical to HF's on the
same (dequantized) weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from benchmarks.write_random_checkpoint import write
from kvserve import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, hf_greedy, random_prompts

TINY_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
    vocab_size=TINY_VOCAB, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, torch_dtype="bfloat16", attention_bias=False, bos_token_id=1, eos_token_id=2)


def _dequantized_copy(src, dst):
    """The checkpoint with every e4m3 weight times its scale (fp32) and no quantization_config: HF's input."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(str(file))
        out = {}
        for name, t in tensors.items():
            if name.endswith("weight_scale"):
                continue
            scale = tensors.get(name[: -len("weight")] + "weight_scale")
            out[name] = t.float() * scale if scale is not None else t.float()
        save_file(out, str(file), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("weight_scale")}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_random_checkpoint_loads_in_kvserve_as_in_hf(tmp_path, monkeypatch, fp8):
    import transformers

    from benchmarks import write_random_checkpoint

    monkeypatch.setattr(write_random_checkpoint, "SHARD_BYTES", 200_000)  # several shards and an index
    path = tmp_path / "ckpt"
    write(TINY_QWEN3_MOE, str(path), fp8, "cpu")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    hf_dir = path
    if fp8:
        config = json.loads((path / "config.json").read_text())
        assert config["quantization_config"]["ignored_layers"] == ["model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]
        hf_dir = tmp_path / "dequantized"
        _dequantized_copy(path, hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompts = random_prompts(3, 1, 40, seed=3)
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20, skip_tokenizer_init=True)
    experts = llm.llm_engine.executor.runner.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == (torch.float8_e4m3fn if fp8 else torch.float32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf, prompts, 8)
