"""Engine limits that come from the model's files, said out loud: a sliding-window model's context is capped
at its window (sliding-window attention is not implemented), with a warning when no --max-model-len was set
and an error naming the cap when a larger one was."""

from __future__ import annotations

import json
import logging

import pytest

from kvserve.config import EngineArgs

CONFIG = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
    "max_position_embeddings": 1024, "sliding_window": 256, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture
def sliding_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path)


def test_sliding_window_caps_max_model_len_with_a_warning(sliding_model, caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.config"):
        config = EngineArgs(model=sliding_model, load_format="dummy", skip_tokenizer_init=True).create_engine_config()
    assert config.max_model_len == 256
    assert any("sliding window of 256 tokens" in r.getMessage() for r in caplog.records)


def test_a_larger_max_model_len_names_the_window(sliding_model):
    with pytest.raises(ValueError, match="--max-model-len 256 or less"):
        EngineArgs(model=sliding_model, load_format="dummy", skip_tokenizer_init=True,
                   max_model_len=512).create_engine_config()
