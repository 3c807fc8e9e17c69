"""GGUF loader: weights and config must match transformers' own GGUF import exactly."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.gguf_loader import (
    gguf_to_hf_name,
    iter_gguf_weights,
    open_gguf,
    read_gguf_config,
)


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf):
    return smollm2_gguf


@pytest.fixture(scope="module")
def reader(gguf_path):
    return open_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_model):
    return smollm2_hf_model


def test_weights_match_transformers_exactly(reader, hf_model):
    expected = hf_model.state_dict()
    seen = set()
    for name, tensor in iter_gguf_weights(reader):
        assert name in expected, f"unexpected tensor {name}"
        assert tensor.dtype == torch.float32
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), f"{name} differs from transformers"
        seen.add(name)
    # Tied checkpoints store no lm_head; transformers exposes it as an alias of the embedding.
    assert set(expected) - seen == {"lm_head.weight"}


def test_config_matches_transformers(reader, hf_model):
    cfg = read_gguf_config(reader)
    hf = hf_model.config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == hf.model_type == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0
    assert cfg["torch_dtype"] == "float32"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (576, 30, 64)
    assert cfg["tie_word_embeddings"] is True


def test_accepts_path_as_well_as_reader(gguf_path, reader):
    assert read_gguf_config(gguf_path) == read_gguf_config(str(gguf_path)) == read_gguf_config(reader)


def test_tensor_names():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_to_hf_name("rope_freqs.weight")


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="Unsupported GGUF architecture 'bert'"):
        read_gguf_config(path)
    with pytest.raises(ValueError, match="Unsupported GGUF architecture 'bert'"):
        next(iter_gguf_weights(path))
