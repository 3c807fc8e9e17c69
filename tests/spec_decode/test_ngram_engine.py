"""--speculative-config ngram end to end: the same tokens (and logprobs) as without it, with drafts that
were really proposed and partly accepted, on each executor and with TP=2."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = dict(max_model_len=160, block_size=16, num_gpu_blocks_override=24, max_num_seqs=4)


def _prompts() -> list[list[int]]:
    # Repetitive prompts: the tiny random model answers them with loops that it later leaves, so lookups
    # propose drafts that are accepted for a while and then rejected.
    return [list(range(100, 110)) * 3, [7] * 20, [500, 600] * 10]


def _run(path, params, num_prompts=3, **flags):
    """(outputs, the drafter's acceptance stats or None)."""
    llm = LLM(path, **{**ENGINE, **flags})
    engine = llm.llm_engine
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()[:num_prompts]], params, use_tqdm=False)
        assert engine.kv_cache_manager.pool.num_free_blocks == engine.kv_cache_manager.num_blocks
        stats = engine.drafter.totals if engine.drafter is not None else None
        return outs, stats
    finally:
        engine.shutdown()


def _tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("flags", [dict(), dict(distributed_executor_backend="mp"), dict(tensor_parallel_size=2)],
                         ids=["uni", "mp", "tp2"])
def test_ngram_gives_the_tokens_of_a_run_without_it(tiny_model_factory, flags):
    path, _ = tiny_model_factory("llama")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected, _ = _run(path, params)
    got, stats = _run(path, params, speculative_config=NGRAM, **flags)
    assert _tokens(got) == _tokens(expected)
    assert stats.num_drafts >= 5 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # Per request in RequestOutput.metrics: the same drafts; accepted ones past max_tokens are not counted.
    assert sum(o.metrics.num_draft_tokens for o in got) == stats.num_draft_tokens
    assert 0 < sum(o.metrics.num_accepted_tokens for o in got) <= stats.num_accepted_tokens
    assert all(o.metrics.num_draft_tokens == 0 for o in expected)


def test_penalties_and_logprobs_with_ngram(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    # Mild penalties: the random model's loops (what the lookups predict) survive them.
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2, presence_penalty=0.01,
                            repetition_penalty=1.01, min_tokens=5)
    expected, _ = _run(path, params)
    got, stats = _run(path, params, speculative_config=NGRAM)
    assert _tokens(got) == _tokens(expected)
    for a, b in zip(got, expected):
        for ca, cb in zip(a.outputs, b.outputs):
            assert len(ca.logprobs) == len(cb.logprobs) == len(cb.token_ids)
            for da, db in zip(ca.logprobs, cb.logprobs):  # per position: same tokens, ranks and logprobs
                assert {t: lp.rank for t, lp in da.items()} == {t: lp.rank for t, lp in db.items()}
                assert [da[t].logprob for t in db] == pytest.approx([db[t].logprob for t in db], abs=1e-4)
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
    assert stats.num_drafts >= 5 and stats.num_accepted_tokens > 0


def test_seeded_sampling_with_ngram_is_reproducible(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    params = SamplingParams(max_tokens=20, temperature=0.2, top_k=2, seed=3, ignore_eos=True)
    first, stats = _run(path, params, speculative_config=NGRAM)
    second, _ = _run(path, params, speculative_config=NGRAM)
    assert _tokens(first) == _tokens(second)
    assert stats.num_drafts >= 5 and stats.num_accepted_tokens > 0


@pytest.mark.slow
def test_smollm2_rewrite_with_ngram_is_exact_and_accepts_drafts():
    """The real SmolLM2 on a prompt-lookup task: identical greedy text, and many drafts accepted."""
    passage = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
               "the members agreed that the library would receive additional funds for new books.")
    params = SamplingParams(max_tokens=48, temperature=0)
    texts, stats = {}, None
    for name, flags in (("off", {}), ("ngram", {"speculative_config": NGRAM})):
        llm = LLM(max_model_len=512, **flags)
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": f"Repeat this passage exactly:\n\n{passage}"}], tokenize=False,
            add_generation_prompt=True)
        try:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            texts[name] = (out.outputs[0].text, list(out.outputs[0].token_ids))
            if llm.llm_engine.drafter is not None:
                stats = llm.llm_engine.drafter.totals
        finally:
            llm.llm_engine.shutdown()
    assert texts["ngram"] == texts["off"]
    assert stats.num_accepted_tokens >= 10 and stats.mean_acceptance_length > 1.5
