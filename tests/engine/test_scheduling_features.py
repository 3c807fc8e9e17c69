"""Each scheduling feature leaves greedy tokens unchanged: prefix caching, chunked prefill, preemption."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _make_llm(path, **engine_kwargs) -> LLM:
    kwargs = dict(max_model_len=512, kv_cache_memory_bytes=32 << 20)
    kwargs.update(engine_kwargs)
    return LLM(path, **kwargs)


def _greedy_tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _generate(path, prompts, **engine_kwargs):
    llm = _make_llm(path, **engine_kwargs)
    return _greedy_tokens(llm, prompts), llm.llm_engine


def _shared_prefix_prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 40000) for _ in range(rng.randint(40, 90))] for _ in range(2)]
    return [
        prefixes[i % 2] + [rng.randrange(3, 40000) for _ in range(rng.randint(1, 30))] for i in range(n)
    ]


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def test_prefix_caching_same_tokens(llama):
    path, hf_model = llama
    prompts = _shared_prefix_prompts()
    off, _ = _generate(path, prompts, enable_prefix_caching=False)
    llm = _make_llm(path, enable_prefix_caching=True)
    engine = llm.llm_engine
    on = _greedy_tokens(llm, prompts)
    assert on == off == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
    stats = engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_hit_rate > 0

    # A second call reuses blocks cached (and since freed) by the first.
    hits_before = stats.prefix_cache_hits
    assert _greedy_tokens(llm, prompts) == off
    assert engine.get_stats().prefix_cache_hits > hits_before
    assert engine.get_stats().kv_cache_usage == 0.0


def test_prefix_hit_within_one_step(llama):
    """Two identical prompts admitted in the same step: the second reads blocks the first is writing."""
    path, hf_model = llama
    prompt = random_prompts(1, 70, 70, seed=5)[0]
    tokens, engine = _generate(path, [prompt, prompt, prompt])
    assert tokens == hf_greedy(hf_model, [prompt], GREEDY.max_tokens) * 3
    assert engine.get_stats().prefix_cache_hits >= 2 * 64


@pytest.mark.parametrize("budget", [16, 8192])
def test_chunked_prefill_same_tokens(llama, budget):
    path, hf_model = llama
    prompts = random_prompts(8, 5, 150, seed=3)
    tokens, _ = _generate(path, prompts, max_num_batched_tokens=budget, max_num_seqs=8, enable_prefix_caching=False)
    assert tokens == hf_greedy(hf_model, prompts, GREEDY.max_tokens)


def test_no_chunked_prefill_same_tokens(llama):
    path, hf_model = llama
    prompts = random_prompts(8, 5, 150, seed=3)
    tokens, _ = _generate(path, prompts, enable_chunked_prefill=False, max_num_batched_tokens=512)
    assert tokens == hf_greedy(hf_model, prompts, GREEDY.max_tokens)


def test_preemption_same_tokens(llama):
    path, hf_model = llama
    prompts = random_prompts(8, 40, 60, seed=4)
    # 12 blocks of 16 = 192 tokens for 8 requests of ~60 tokens each: preemption is unavoidable.
    tokens, engine = _generate(path, prompts, num_gpu_blocks_override=12, max_model_len=128)
    assert engine.get_stats().num_preemptions > 0
    assert tokens == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
    assert engine.kv_cache_manager.pool.num_free_blocks == 12


def test_all_features_together(llama):
    """Prefix hits + tiny chunks + preemption in one run still give the oracle's tokens."""
    path, hf_model = llama
    prompts = _shared_prefix_prompts(8, seed=9)
    tokens, engine = _generate(
        path, prompts, num_gpu_blocks_override=14, max_model_len=160, max_num_batched_tokens=24, max_num_seqs=6
    )
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert tokens == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
