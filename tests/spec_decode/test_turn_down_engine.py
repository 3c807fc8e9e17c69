"""Speculation turned down costs what no speculation costs: the engine does not call the proposer, steps stay
asynchronous (one in flight while the next is scheduled), the tokens are those of a run without it; and a
proposer that never finds drafts is turned off after a few steps and then only asked on rare probes."""

from __future__ import annotations

from kvserve import LLM, SamplingParams
from kvserve.spec_decode.drafter import Drafter
from tests.conftest import random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = dict(max_model_len=256, block_size=16, num_gpu_blocks_override=400, max_num_seqs=16, async_scheduling=True)


def _run(path, prompts, max_tokens, spec=None, budget_device="cpu", proposer=None):
    """(tokens, engine steps, steps that returned with a step in flight, proposer calls, drafter)."""
    llm = LLM(path, **ENGINE, **({"speculative_config": spec} if spec else {}))
    engine = llm.llm_engine
    calls = [0]
    if spec:
        drafter = engine.drafter = engine.proposer = Drafter(engine.config.args.speculative_config, budget_device)
        inner = proposer or drafter.proposer

        def counted(requests, num_tokens=None):
            calls[0] += 1
            return inner.propose(requests, num_tokens)
        drafter.proposer = type("Counted", (), {"propose": staticmethod(counted)})()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p},
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    tokens, steps, overlapped = {}, 0, 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
            overlapped += engine._in_flight is not None
    finally:
        engine.shutdown()
    return [tokens[str(i)] for i in range(len(prompts))], steps, overlapped, calls[0], engine.drafter


def test_turned_down_by_the_batch_the_proposer_never_runs_and_steps_stay_async(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    # 16 requests on a CPU budget (saturation at 8 tokens): drafts can never pay at this batch.
    prompts = [p * 3 for p in random_prompts(16, 5, 10, seed=1)]  # repeats: lookups would find drafts
    plain, plain_steps, plain_overlapped, _, _ = _run(path, prompts, 24)
    tokens, steps, overlapped, calls, drafter = _run(path, prompts, 24, NGRAM)
    assert tokens == plain
    assert calls == 0 and drafter.totals.num_drafts == 0
    assert drafter.last_choice.reason == "batch size"
    assert (steps, overlapped) == (plain_steps, plain_overlapped) and overlapped > steps // 2


class _FindsNothing:
    def propose(self, requests, num_tokens=None):
        return {}


def test_a_proposer_that_finds_nothing_is_turned_off_and_only_probed(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    prompts = random_prompts(2, 10, 20, seed=2)
    plain, _, _, _, _ = _run(path, prompts, 160)
    # The GPU budget (a verify step costs 1.3x): a share of requests with drafts under about 20% cannot pay.
    tokens, steps, overlapped, calls, drafter = _run(path, prompts, 160, NGRAM, "cuda", _FindsNothing())
    assert tokens == plain
    assert drafter.budget.hit_rate < 0.25 and drafter.last_choice.reason in ("acceptance", "probe")
    # About 16 steps to learn that (two requests a step), then probes after 32, 64 more steps: a few calls.
    assert 8 <= calls <= 24 < steps
    assert overlapped > steps // 2  # off, the steps are asynchronous again
