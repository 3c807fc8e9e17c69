"""Seeded sampling is reproducible: the same seed gives the same tokens alone, inside a batch of 16
mixed requests, and under different chunked-prefill settings."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import random_prompts

TARGET = SamplingParams(temperature=0.8, top_p=0.95, top_k=200, seed=1234, max_tokens=8, ignore_eos=True)


def _mixed_params() -> list[SamplingParams]:
    """15 neighbours that exercise every sampler path around the seeded target."""
    kinds = [
        dict(temperature=0),
        dict(temperature=1.0),  # unseeded: draws from the global generator
        dict(temperature=0.7, seed=7),
        dict(temperature=1.2, top_k=5, seed=8),
        dict(temperature=0.9, min_p=0.1),
        dict(temperature=0, repetition_penalty=1.3, presence_penalty=0.5),
        dict(temperature=1.0, frequency_penalty=1.0, logprobs=2),
        dict(temperature=0.5, logit_bias={100: 3.0}, seed=9),
        dict(temperature=1.0, allowed_token_ids=list(range(50, 90))),
        dict(temperature=0.8, top_p=0.5, prompt_logprobs=1),
        dict(temperature=0, min_tokens=3),
        dict(temperature=1.0, seed=1234),  # the target's seed, other settings
        dict(temperature=0.3),
        dict(temperature=1.0, n=2, seed=5),
        dict(temperature=0, logprobs=0),
    ]
    return [SamplingParams(max_tokens=3 + i % 7, ignore_eos=True, **k) for i, k in enumerate(kinds)]


def _target_tokens(llm, prompts, params, position):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs[position].outputs[0].token_ids


@pytest.fixture(scope="module")
def path(tiny_model_factory):
    return tiny_model_factory("llama")[0]


def test_same_seed_same_tokens(path):
    prompts = random_prompts(16, 10, 60, seed=42)
    params = _mixed_params()
    params.insert(7, TARGET)
    results = []
    for engine_kwargs in [
        dict(),
        dict(max_num_batched_tokens=16, max_num_seqs=16, enable_prefix_caching=False),  # 16-token prefill chunks
        dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
    ]:
        llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=16 << 20, **engine_kwargs)
        alone = _target_tokens(llm, [prompts[7]], [TARGET], 0)
        batched = _target_tokens(llm, prompts, params, 7)
        again = _target_tokens(llm, [prompts[7]], [TARGET], 0)  # after other work
        results.append((alone, batched, again))
    tokens = results[0][0]
    assert len(tokens) == TARGET.max_tokens
    assert all(r == (tokens, tokens, tokens) for r in results), results
    other_seed = TARGET.clone()
    other_seed.seed = 4321
    assert _target_tokens(llm, [prompts[7]], [other_seed], 0) != tokens
