"""Multi-token steps end to end: draft tokens offered by a test-only proposer (taken from a reference run,
some of them deliberately wrong) give greedy tokens identical to a run without drafts, whichever executor
and layout runs them, with prefix hits, chunked prefill, preemption by recompute and by swap, n > 1 and a
stop string that completes inside an accepted draft."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import random_prompts

K = 3  # drafts offered per request per step
MAX_TOKENS = 10
# 5 blocks of 16 tokens cannot hold the three prompts (36-44 tokens) at once: preemptions; a 32-token
# budget chunks every prompt; prompts 0 and 1 share two full blocks: a prefix-cache hit.
ENGINE = dict(max_model_len=80, block_size=16, num_gpu_blocks_override=5, max_num_batched_tokens=32,
              max_num_seqs=3, enable_chunked_prefill=True, enable_prefix_caching=True)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    base = random_prompts(3, 36, 44, seed=7)
    return [base[0], base[0][:32] + base[1][:9], base[2]]


class ReferenceProposer:
    """Offers the next K tokens of a reference run per request (by prompt), with (if `wrong`) every draft
    at an output position p where p % 4 == 3 replaced by a wrong token, and a wrong filler past the
    reference's end."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], vocab_size: int, wrong: bool = True):
        self.reference = reference
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.proposed_at: dict[tuple[int, ...], list[int]] = {}  # prompt -> output lengths offered drafts at

    def propose(self, requests) -> dict[str, list[int]]:
        drafts = {}
        for r in requests:
            ref = self.reference[tuple(r.prompt_token_ids)]
            n = len(r.output_token_ids)
            tokens = []
            for p in range(n, n + K):
                right = ref[p] if p < len(ref) else 5
                wrong = p >= len(ref) or (self.wrong and p % 4 == 3)
                tokens.append((right + 1) % self.vocab_size if wrong else right)
            drafts[r.request_id] = tokens
            self.proposed_at.setdefault(tuple(r.prompt_token_ids), []).append(n)
        return drafts


def _generate(path: str, params: SamplingParams, proposer_from=None, wrong_drafts: bool = True, **flags):
    """(token ids per prompt and sample, texts, finish reasons, engine stats, scheduler, proposer)."""
    llm = LLM(path, **{**ENGINE, **flags})
    engine = llm.llm_engine
    proposer = None
    try:
        if proposer_from is not None:
            proposer = ReferenceProposer(proposer_from, engine.config.model_config.vocab_size, wrong_drafts)
            engine.set_proposer(proposer)
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
        assert engine.kv_cache_manager.pool.num_free_blocks == engine.kv_cache_manager.num_blocks
        engine.kv_cache_manager.check_invariants()
        tokens = [[list(c.token_ids) for c in o.outputs] for o in outs]
        texts = [[c.text for c in o.outputs] for o in outs]
        reasons = [[c.finish_reason for c in o.outputs] for o in outs]
        return tokens, texts, reasons, engine.get_stats(), engine.scheduler, proposer
    finally:
        engine.shutdown()


_REFERENCE: dict = {}


def _reference(path: str, params: SamplingParams = GREEDY, key: str = "greedy"):
    if (path, key) not in _REFERENCE:
        _REFERENCE[path, key] = _generate(path, params)
    return _REFERENCE[path, key]


def _by_prompt(tokens) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): samples[0] for p, samples in zip(_prompts(), tokens)}


def _check_drafts_were_verified(sched) -> None:
    # The run really verified drafts, and the wrong ones were really rejected.
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens


@pytest.mark.parametrize("flags", [
    dict(),
    dict(preemption_mode="swap", swap_space=0.01),
    dict(distributed_executor_backend="mp"),
    dict(tensor_parallel_size=2),
    dict(pipeline_parallel_size=2),
], ids=["uni-recompute", "uni-swap", "mp", "tp2", "pp2"])
def test_drafts_give_the_tokens_of_a_run_without_them(tiny_model_factory, flags):
    path, _ = tiny_model_factory("llama")  # 2 layers, 4 heads, 2 KV heads: TP=2 and PP=2 both fit
    expected = _reference(path)[0]
    tokens, _, _, stats, sched, _ = _generate(path, GREEDY, proposer_from=_by_prompt(expected), **flags)
    assert tokens == expected
    _check_drafts_were_verified(sched)
    # The features this configuration was built to exercise did happen.
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    if flags.get("preemption_mode") == "swap":
        assert stats.num_preemptions_by_mode["swap"] > 0


def test_drafts_with_n_samples(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    params = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected = _reference(path, params, "n2")[0]
    assert all(len(samples) == 2 for samples in expected)
    tokens, _, _, _, sched, _ = _generate(path, params, proposer_from=_by_prompt(expected))
    assert tokens == expected
    _check_drafts_were_verified(sched)


def test_stop_string_inside_an_accepted_draft(tiny_model_factory, smol_tokenizer):
    path, _ = tiny_model_factory("llama")
    full = _reference(path)[0]
    # A stop string completed by the 7th token of prompt 0's output: the whole text up to it is unique
    # enough that the string ends there (or earlier, identically with and without drafts).
    stop = smol_tokenizer.decode(full[0][0][4:7])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=[stop])
    expected, texts, reasons, _, _, _ = _reference(path, params, "stop")
    assert reasons[0] == ["stop"] and len(expected[0][0]) < MAX_TOKENS
    # Correct drafts all the way (the reference has no wrong tokens past the stop): the step that
    # completes the stop string has accepted drafts after it, which are dropped.
    tokens, got_texts, got_reasons, _, sched, proposer = _generate(path, params, proposer_from=_by_prompt(full),
                                                                   wrong_drafts=False)
    assert tokens == expected and got_texts == texts and got_reasons == reasons
    assert sched.num_accepted_tokens > 0
    stop_len = len(expected[0][0])
    offered = proposer.proposed_at[tuple(_prompts()[0])]
    assert any(n < stop_len < n + K + 1 for n in offered), (offered, stop_len)


def test_drafts_with_the_ray_executor(tiny_model_factory):
    ray = pytest.importorskip("ray")
    path, _ = tiny_model_factory("llama")
    expected = _reference(path)[0]
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False)
    try:
        tokens, _, _, stats, sched, _ = _generate(path, GREEDY, proposer_from=_by_prompt(expected),
                                                  distributed_executor_backend="ray", tensor_parallel_size=2)
    finally:
        if started:
            ray.shutdown()
    assert tokens == expected
    _check_drafts_were_verified(sched)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
