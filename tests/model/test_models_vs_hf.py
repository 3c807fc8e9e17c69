"""Greedy tokens of our model code equal HF transformers' on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompts

MAX_TOKENS = 16


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_models_match_hf(tiny_model_factory, arch):
    path, hf_model = tiny_model_factory(arch)
    prompts = random_prompts(10, 1, 200, seed=len(arch) * 7 + ord(arch[-1]))
    llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    for prompt, out, exp in zip(prompts, outs, expected):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == exp, f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.slow
def test_smollm2_matches_hf(smol_tokenizer, smollm2_hf_model):
    hf_model = smollm2_hf_model
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived a",
        "1, 2, 3, 4,",
        "Water boils at a temperature of",
        "The quick brown fox jumps over the lazy dog. " * 12,
        "In machine learning, a transformer is a deep learning architecture that relies on the attention "
        "mechanism. It was introduced in 2017 by researchers at Google. Since then, it has become",
        "Hello",
        "Translate to French: I like apples. ->",
    ]
    prompts = [smol_tokenizer.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) >= 8
    llm = LLM(max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(texts, params, use_tqdm=False)
    expected = hf_greedy(hf_model, prompts, 24)
    for text, out, exp in zip(texts, outs, expected):
        assert out.prompt_token_ids == smol_tokenizer.encode(text)
        assert out.outputs[0].token_ids == exp, text
        assert out.outputs[0].text == smol_tokenizer.decode(exp, skip_special_tokens=True)
