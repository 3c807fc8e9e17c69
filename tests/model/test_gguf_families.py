"""GGUF checkpoints of the dense families beyond Llama/Qwen, written here the way llama.cpp's converter
lays them out (F32, llama.cpp's tensor names) from a tiny random HF model: kvserve loads them with HF's
greedy tokens, and `kvserve plan` reads them."""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pytest

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.cli import main as cli_main
from tests.conftest import WINDOW, hf_greedy, random_prompts

gguf = pytest.importorskip("gguf")

MAX_TOKENS = 8


def _write_gguf(hf_model, gguf_arch: str, path) -> None:
    from safetensors.torch import load_file

    from kvserve.model import gguf_loader

    cfg = hf_model.config
    spec = gguf_loader._ARCHS[gguf_arch]
    to_gguf = {hf: g for g, hf in gguf_loader.layer_tensor_names(spec).items()}
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    for key, value in (("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("block_count", cfg.num_hidden_layers), ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads),
                       ("context_length", cfg.max_position_embeddings), ("vocab_size", cfg.vocab_size)):
        writer.add_uint32(f"{gguf_arch}.{key}", value)
    writer.add_float32(f"{gguf_arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{gguf_arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        state = load_file(f"{tmp}/model.safetensors")
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            writer.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
                               "output_norm.weight", "lm_head.weight": "output.weight"}[name], np.ascontiguousarray(w))
            continue
        _, _, layer, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        writer.add_tensor(f"blk.{layer}.{to_gguf[module]}.{suffix}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,gguf_arch", [("olmo2", "olmo2")])
def test_gguf_family_matches_hf_and_plans(tiny_model_factory, tmp_path, capsys, arch, gguf_arch):
    _, hf_model = tiny_model_factory(arch)
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(hf_model, gguf_arch, path)
    prompts = random_prompts(3, WINDOW, 3 * WINDOW, seed=17)
    llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=16 << 20, skip_tokenizer_init=True,
              max_num_batched_tokens=32, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_model, prompts, MAX_TOKENS)
    assert llm.llm_engine.config.model_config.architecture == hf_model.config.architectures[0]
    assert cli_main(["plan", str(path), "--gpu", "H100", "--max-model-len", "256", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # The plan counts the linear layers and embeddings exactly, norms roughly (per-family norms are small).
    assert plan["num_params"] == pytest.approx(sum(p.numel() for p in hf_model.parameters()), rel=1e-3)
    assert plan["num_blocks"] > 0
