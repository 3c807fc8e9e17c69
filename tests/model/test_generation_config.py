"""generation_config.json's sampling defaults apply to requests that leave them unset (vLLM's
--generation-config auto|vllm|PATH and --override-generation-config), in the library and the server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.generation_config import default_sampling_fields
from tests.server_utils import RemoteServer

ARGS = dict(max_model_len=128, kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def model_with_generation_config(tiny_model_factory, tmp_path_factory) -> Path:
    path, _ = tiny_model_factory("llama")
    out = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(path, out)
    cfg = json.loads((out / "generation_config.json").read_text())
    # Greedy and short by default: easy to observe, and far from SamplingParams' own defaults.
    cfg.update({"temperature": 0.0, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.0, "max_new_tokens": 5,
                "do_sample": True})
    (out / "generation_config.json").write_text(json.dumps(cfg))
    return out


def test_fields_read_as_vllm_does(model_with_generation_config, tmp_path):
    d = model_with_generation_config
    expected = {"temperature": 0.0, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.0, "max_tokens": 5}
    assert default_sampling_fields(d, "auto") == expected
    assert default_sampling_fields(d, "vllm") == {}
    assert default_sampling_fields(d, "vllm", '{"temperature": 0.5}') == {"temperature": 0.5}
    assert default_sampling_fields(d, "auto", {"top_k": 3}) == {**expected, "top_k": 3}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"min_p": 0.2, "temperature": null}')
    assert default_sampling_fields(d, str(other)) == {"min_p": 0.2}
    with pytest.raises(ValueError, match="no generation_config.json there"):
        default_sampling_fields(d, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="must be a JSON object"):
        default_sampling_fields(d, "auto", "temperature=0")
    with pytest.raises(ValueError, match="tempreature not understood"):
        default_sampling_fields(d, "auto", '{"tempreature": 0}')


def test_library_defaults_fill_unset_params(model_with_generation_config):
    d = str(model_with_generation_config)
    llm = LLM(d, **ARGS)
    assert llm.llm_engine.config.default_sampling == {"temperature": 0.0, "top_p": 0.9, "top_k": 7,
                                                      "repetition_penalty": 1.0, "max_tokens": 5}
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    prompts = [[5, 17, 300, 41], [9, 8, 7]]
    # No params: the model's defaults (greedy, 5 tokens) -- the same tokens as asking for them explicitly.
    implicit = [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]
    explicit = llm.generate(prompts, SamplingParams(temperature=0, top_p=0.9, top_k=7, max_tokens=5), use_tqdm=False)
    assert implicit == [o.outputs[0].token_ids for o in explicit]
    assert all(len(t) == 5 for t in implicit)
    # --generation-config vllm: SamplingParams' own defaults (max_tokens 16, temperature 1).
    neutral = LLM(d, generation_config="vllm", **ARGS).get_default_sampling_params()
    assert (neutral.temperature, neutral.top_k, neutral.max_tokens) == (1.0, 0, 16)


def test_server_applies_defaults_to_unset_fields(model_with_generation_config):
    server = RemoteServer(str(model_with_generation_config), "--max-model-len", "128",
                          "--kv-cache-memory-bytes", str(8 << 20))
    try:
        messages = [{"role": "user", "content": "Say something"}]
        url = server.url + "/v1/chat/completions"
        unset = httpx.post(url, json={"messages": messages}, timeout=120).json()
        # max_new_tokens 5 caps an unset max_tokens; temperature 0 makes it greedy, so equal to an explicit ask.
        assert unset["usage"]["completion_tokens"] == 5, unset
        greedy = httpx.post(url, json={"messages": messages, "temperature": 0, "max_tokens": 5}, timeout=120).json()
        assert unset["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
        # What a request sets wins over the defaults.
        longer = httpx.post(url, json={"messages": messages, "max_tokens": 9, "ignore_eos": True}, timeout=120).json()
        assert longer["usage"]["completion_tokens"] == 9
        assert "Default sampling parameters from the model's generation_config.json" in server.log_tail(20000)
    finally:
        server.stop()
