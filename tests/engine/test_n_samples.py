"""n > 1: the samples of one prompt share its KV blocks and come back as one RequestOutput."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompts

BLOCK = 16


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def _llm(path, **kwargs):
    return LLM(path, max_model_len=640, kv_cache_memory_bytes=16 << 20, max_num_seqs=8, **kwargs)


@pytest.mark.parametrize("engine_kwargs", [
    dict(enable_prefix_caching=False, max_num_batched_tokens=128),  # shared by reference, prompt in 4 chunks
    dict(enable_prefix_caching=True),  # whole prompt in one step
])
def test_prompt_blocks_allocated_once(llama, engine_kwargs):
    llm = _llm(llama[0], **engine_kwargs)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    prompt = random_prompts(1, 500, 500, seed=31)[0]
    engine.add_request("p", {"prompt_token_ids": prompt},
                       SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    children = [f"{i}_p" for i in range(4)]
    seen: dict[str, list[int]] = {}
    peak_used = 0
    final = []
    while engine.has_unfinished_requests():
        final += [o for o in engine.step() if o.finished]
        for c in children:
            if kv.block_ids(c):
                seen[c] = kv.block_ids(c)
        peak_used = max(peak_used, kv.num_blocks - kv.pool.num_free_blocks)
        kv.check_invariants()
    full = len(prompt) // BLOCK  # 31 full prompt blocks; 500 + 8 tokens end in block 32 of each sample
    tables = [seen[c] for c in children]
    assert all(len(t) == full + 1 for t in tables)
    assert all(t[:full] == tables[0][:full] for t in tables), "samples do not share the prompt's full blocks"
    distinct = {b for t in tables for b in t}
    assert len(distinct) == full + 4  # the prompt's full blocks once, plus one own block per sample
    assert peak_used == full + 4
    assert kv.usage() == 0.0

    (out,) = final
    assert out.request_id == "p" and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4  # different samples


def test_samples_are_reproducible_and_match_single_requests(llama):
    """Sample i draws from seed + i, so it equals an n=1 request with that seed: sharing the prompt's
    blocks changes nothing the model computes."""
    llm = _llm(llama[0])
    prompt = random_prompts(1, 40, 40, seed=32)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    singles = llm.generate(
        [{"prompt_token_ids": prompt}] * 3,
        [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True) for i in range(3)],
        use_tqdm=False)
    tokens = [c.token_ids for c in first.outputs]
    assert tokens == [c.token_ids for c in again.outputs]
    assert tokens == [s.outputs[0].token_ids for s in singles]
    assert params.n == 3 and params.seed == 11  # the caller's params are left as they were


def test_greedy_samples_equal_hf(llama):
    path, hf = llama
    llm = _llm(path, enable_prefix_caching=False, max_num_batched_tokens=32)
    prompt = random_prompts(1, 75, 75, seed=33)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    ref = hf_greedy(hf, [prompt], 6)[0]
    assert [c.token_ids for c in out.outputs] == [ref, ref]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_abort_parent_aborts_every_sample(llama):
    llm = _llm(llama[0])
    engine = llm.llm_engine
    engine.add_request("q", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("q")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage() == 0.0
    engine.add_request("q", {"prompt_token_ids": [5, 6]}, SamplingParams(n=2, max_tokens=1))  # the id is free again
    while engine.has_unfinished_requests():
        engine.step()


def test_preemption_keeps_samples_and_prompt_logprobs(llama):
    """Too few blocks for all samples: some are preempted and recomputed, with the same results."""
    prompt = random_prompts(1, 40, 40, seed=34)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    roomy = _llm(llama[0]).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    tight = LLM(llama[0], max_model_len=128, num_gpu_blocks_override=9, max_num_seqs=4)
    out = tight.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert tight.llm_engine.get_stats().num_preemptions > 0
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in roomy.outputs]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for a, b in zip(out.prompt_logprobs[1:], roomy.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
