"""Async scheduling (step N+1 scheduled before step N's tokens are read back) changes no output.

On CPU there is nothing to overlap, but the bookkeeping is the same as on a GPU: placeholders for the
tokens in flight, ids filled from the previous step's sampled tensor, results applied one step late,
requests that finish (or are aborted, or preempted) while a later step already computes for them.
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompts
from tests.engine.test_scheduling_features import _shared_prefix_prompts


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def _llm(path, async_scheduling: bool, **kw) -> LLM:
    args = dict(max_model_len=256, kv_cache_memory_bytes=32 << 20, async_scheduling=async_scheduling)
    args.update(kw)
    return LLM(path, **args)


def _outputs(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.cumulative_logprob) for c in o.outputs] for o in outs]


def _both(path, prompts, params, **kw):
    results = []
    for mode in (False, True):
        llm = _llm(path, mode, **kw)
        results.append(_outputs(llm, prompts, params))
        engine = llm.llm_engine
        assert not engine.has_unfinished_requests()
        assert engine.kv_cache_manager.pool.num_free_blocks == engine.kv_cache_manager.num_blocks
    return results


def test_greedy_with_every_scheduling_feature_matches_hf(llama):
    """Prefix hits, 24-token chunks and preemption, async on and off, against the HF oracle."""
    path, hf_model = llama
    prompts = _shared_prefix_prompts(8, seed=9)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(num_gpu_blocks_override=14, max_model_len=160, max_num_batched_tokens=24, max_num_seqs=6)
    llm = _llm(path, True, **kw)
    on = _outputs(llm, prompts, params)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    off = _outputs(_llm(path, False, **kw), prompts, params)
    assert on == off
    assert [o[0][0] for o in on] == hf_greedy(hf_model, prompts, params.max_tokens)


def test_requests_that_stop_early_and_differ_in_length(llama):
    """Stop tokens end requests while the next step already computes for them; lengths 1..20."""
    path, _ = llama
    prompts = random_prompts(10, 3, 60, seed=11)
    greedy = _outputs(_llm(path, False), prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    # Stop at tokens the greedy run actually produces, so several requests stop mid-way.
    stops = sorted({o[0][0][5] for o in greedy[:4]})
    params = [SamplingParams(temperature=0, max_tokens=1 + i * 2, stop_token_ids=stops) for i in range(10)]
    off, on = _both(path, prompts, params)
    assert on == off
    assert any(o[0][1] == "stop" for o in on) and any(o[0][1] == "length" for o in on)


def test_seeded_sampling_logprobs_and_n(llama):
    path, _ = llama
    prompts = random_prompts(6, 5, 40, seed=12)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, n=3, max_tokens=10, logprobs=3,
                            ignore_eos=True)
    off, on = _both(path, prompts, params)
    assert on == off


def test_penalties_and_bad_words_fall_back_to_waiting(llama):
    """Samplers that read the output history make the engine wait for each step's tokens."""
    path, _ = llama
    prompts = random_prompts(6, 5, 40, seed=13)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3
    off, on = _both(path, prompts, params)
    assert on == off


def test_abort_while_a_step_is_in_flight(llama):
    path, _ = llama
    llm = _llm(path, True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(random_prompts(4, 10, 30, seed=14)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None  # a step's tokens are still unread
    engine.abort_request(["r1", "r2"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
    assert finished == {"r0": 30, "r3": 30}
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.kv_cache_manager.num_blocks
    engine.step()  # the runner hears of the last finished requests with the next schedule
    assert engine.runner.input_batch.block_tables.rows == {}
