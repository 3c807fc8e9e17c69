"""--speculative-config draft_model end to end: the same greedy tokens as without it, whichever draft (a
smaller random model, a noisy copy of the target that is right part of the time, the target itself as an
oracle that is always right), executor and layout, with prefix hits, chunked prefill and preemption by
recompute and by swap; the draft's KV cache is sized in the same blocks; a vocabulary mismatch is refused."""

from __future__ import annotations

import copy

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs
from tests.conftest import TINY_VOCAB
from tests.spec_decode.engine_settings import GREEDY, ROOMY, TIGHT, shared_prefix_prompts

K = 3


def _prompts() -> list[list[int]]:
    return shared_prefix_prompts(seed=7)


def _spec(draft: str, k: int = K) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


def _save(model, path, tokenizer) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def drafts(tiny_model_factory, tmp_path_factory, smol_tokenizer):
    """name -> draft checkpoint for the tiny llama target: "small" (1 layer, hidden 32, random), "noisy"
    (the target's weights plus noise: right part of the time), "oracle" (the target itself)."""
    import transformers

    path, hf = tiny_model_factory("llama")
    torch.manual_seed(99)
    small_cfg = transformers.LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=2,
                                         bos_token_id=1)
    small = transformers.AutoModelForCausalLM.from_config(small_cfg).eval()
    noisy = copy.deepcopy(hf)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.2)
    return {"small": _save(small, tmp_path_factory.mktemp("draft-small"), smol_tokenizer),
            "noisy": _save(noisy, tmp_path_factory.mktemp("draft-noisy"), smol_tokenizer),
            "oracle": path}


def _run(path: str, engine: dict, params=GREEDY, spec: dict | None = None, **flags):
    """(token ids per prompt, engine stats, the drafter's totals or None). Drafts stay on whatever the
    draft costs: the budget's choice is tested on its own (test_draft_budget.py), here exactness is."""
    llm = LLM(path, **{**engine, **flags}, **({"speculative_config": spec} if spec else {}))
    eng = llm.llm_engine
    try:
        if eng.drafter is not None:
            eng.drafter.budget.draft_step_cost = 0.0
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
        assert eng.kv_cache_manager.pool.num_free_blocks == eng.kv_cache_manager.num_blocks
        eng.kv_cache_manager.check_invariants()
        totals = eng.drafter.totals.copy() if eng.drafter is not None else None
        return [list(o.outputs[0].token_ids) for o in outs], eng.get_stats(), totals, outs
    finally:
        eng.shutdown()


_REFERENCE: dict = {}


def _reference(path: str, engine_name: str, engine: dict):
    if (path, engine_name) not in _REFERENCE:
        _REFERENCE[path, engine_name] = _run(path, engine)[0]
    return _REFERENCE[path, engine_name]


@pytest.mark.parametrize("flags", [
    dict(),
    dict(preemption_mode="swap", swap_space=0.01),
    dict(distributed_executor_backend="mp"),
    dict(tensor_parallel_size=2),
], ids=["uni-recompute", "uni-swap", "mp", "tp2"])
def test_noisy_draft_gives_the_tokens_of_a_run_without_it(tiny_model_factory, drafts, flags):
    path, _ = tiny_model_factory("llama")
    expected = _reference(path, "tight", TIGHT)
    tokens, stats, totals, outs = _run(path, TIGHT, spec=_spec(drafts["noisy"]), **flags)
    assert tokens == expected
    # Drafts were verified, some accepted and some rejected (their draft K/V rolled back and rewritten),
    # while prefix hits and preemptions happened.
    assert totals.num_drafts >= 5 and 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    if flags.get("preemption_mode") == "swap":
        assert stats.num_preemptions_by_mode["swap"] > 0
    assert sum(o.metrics.num_draft_tokens for o in outs) == totals.num_draft_tokens


def test_smaller_random_draft_gives_the_tokens_of_a_run_without_it(tiny_model_factory, drafts):
    path, _ = tiny_model_factory("llama")
    tokens, _, totals, _ = _run(path, TIGHT, spec=_spec(drafts["small"]))
    assert tokens == _reference(path, "tight", TIGHT)
    assert totals.num_draft_tokens > 0


@pytest.mark.parametrize("flags", [dict(), dict(tensor_parallel_size=2)], ids=["uni", "tp2"])
def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_model_factory, drafts, flags):
    path, _ = tiny_model_factory("llama")
    tokens, stats, totals, _ = _run(path, ROOMY, spec=_spec(drafts["oracle"], k=4), **flags)
    assert tokens == _reference(path, "roomy", ROOMY)
    assert stats.prefix_cache_hits > 0  # prompt 1's prefix: its draft K/V is recomputed, still exact
    assert totals.num_drafts >= 3 and totals.num_accepted_tokens == totals.num_draft_tokens


def test_penalties_logprobs_and_seeded_sampling_with_a_draft_model(tiny_model_factory, drafts):
    path, _ = tiny_model_factory("llama")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2, presence_penalty=0.01,
                            repetition_penalty=1.01, min_tokens=3)
    expected = _run(path, ROOMY, params)[3]
    got = _run(path, ROOMY, params, spec=_spec(drafts["oracle"]))[3]
    for a, b in zip(got, expected):
        ca, cb = a.outputs[0], b.outputs[0]
        assert list(ca.token_ids) == list(cb.token_ids)
        for da, db in zip(ca.logprobs, cb.logprobs):
            assert {t: lp.rank for t, lp in da.items()} == {t: lp.rank for t, lp in db.items()}
            assert [da[t].logprob for t in db] == pytest.approx([db[t].logprob for t in db], abs=1e-4)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    first = _run(path, ROOMY, seeded, spec=_spec(drafts["noisy"]))[0]
    assert _run(path, ROOMY, seeded, spec=_spec(drafts["noisy"]))[0] == first


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_factory, tmp_path, smol_tokenizer):
    import transformers

    path, _ = tiny_model_factory("llama")
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    other = _save(transformers.AutoModelForCausalLM.from_config(cfg), tmp_path / "other", smol_tokenizer)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens and the target 49152.*share the target's tokenizer"):
        EngineArgs(model=path, speculative_config=_spec(other)).create_engine_config()


def test_a_draft_is_refused_with_pipeline_parallelism(tiny_model_factory, drafts):
    path, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="pipeline-parallel-size 1 only"):
        EngineArgs(model=path, pipeline_parallel_size=2, distributed_executor_backend="mp",
                   speculative_config=_spec(drafts["small"])).create_engine_config()


def test_the_draft_cache_shares_the_blocks_and_the_plan_counts_it(tiny_model_factory, drafts):
    """Each block holds both models' K/V: the runner's bytes per block is the plan's, draft included,
    and the plan counts the draft's weights."""
    from kvserve.sizing import memory_plan
    from kvserve.worker import memory

    path, _ = tiny_model_factory("llama")
    plain = EngineArgs(model=path, **ROOMY).create_engine_config()
    with_draft = EngineArgs(model=path, **ROOMY, speculative_config=_spec(drafts["small"])).create_engine_config()
    draft_cfg = with_draft.draft_model_config
    per_token = 1 * 2 * 2 * draft_cfg.head_dim * 4  # 1 layer, 2 KV heads, K and V, fp32
    assert memory.kv_bytes_per_block(with_draft) == memory.kv_bytes_per_block(plain) + per_token * 16
    plan = memory_plan.make_plan(memory.plan_inputs(with_draft, total_gpu_bytes=80 << 30))
    base = memory_plan.make_plan(memory.plan_inputs(plain, total_gpu_bytes=80 << 30))
    assert plan.ranks[0].kv_bytes_per_token == base.ranks[0].kv_bytes_per_token + per_token
    assert plan.ranks[0].weights - base.ranks[0].weights == plan.ranks[0].draft_weights > 0
    llm = LLM(path, **ROOMY, speculative_config=_spec(drafts["small"]))
    try:
        runner = llm.llm_engine.runner
        assert runner.kv_bytes_per_block() == memory.kv_bytes_per_block(with_draft)
        assert runner.draft_runner.kv_caches[0].shape[1] == runner.kv_caches[0].shape[1] == 40
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_smollm2_with_a_small_draft_and_with_itself_as_oracle(tmp_path, smol_tokenizer):
    """The real SmolLM2: identical greedy text with a small random draft sharing its vocabulary, and
    with SmolLM2 itself as the draft, which has every draft accepted."""
    import transformers

    from kvserve.model.default_model import find_default_gguf

    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=96, intermediate_size=192, num_hidden_layers=1,
                                   num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=8192,
                                   tie_word_embeddings=True)
    small = _save(transformers.AutoModelForCausalLM.from_config(cfg).eval(), tmp_path / "small", smol_tokenizer)
    params = SamplingParams(max_tokens=24, temperature=0)
    prompt = None
    results = {}
    for name, spec in (("off", None), ("small", _spec(small)), ("oracle", _spec(str(find_default_gguf()), k=4))):
        llm = LLM(max_model_len=512, **({"speculative_config": spec} if spec else {}))
        eng = llm.llm_engine
        try:
            if eng.drafter is not None:
                eng.drafter.budget.draft_step_cost = 0.0
            if prompt is None:
                prompt = llm.get_tokenizer().apply_chat_template(
                    [{"role": "user", "content": "Name three rivers of Europe."}], tokenize=False,
                    add_generation_prompt=True)
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            results[name] = (list(out.outputs[0].token_ids), eng.drafter.totals.copy() if eng.drafter else None)
        finally:
            eng.shutdown()
    assert results["small"][0] == results["off"][0] and results["oracle"][0] == results["off"][0]
    oracle = results["oracle"][1]
    assert oracle.num_drafts >= 3 and oracle.num_accepted_tokens == oracle.num_draft_tokens
    assert results["small"][1].num_draft_tokens > 0


def test_kvserve_plan_counts_the_draft(tiny_model_factory, drafts, capsys):
    import json

    from kvserve.entrypoints.cli import main as cli_main

    path, _ = tiny_model_factory("llama")
    base = ["plan", path, "--gpu", "H200", "--max-model-len", "1024", "--json"]
    assert cli_main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli_main(base + ["--speculative-config", json.dumps(_spec(drafts["small"]))]) == 0
    with_draft = json.loads(capsys.readouterr().out)
    draft_per_token = 1 * 2 * 2 * 8 * 2  # the small draft: 1 layer, 2 KV heads of 8, K and V, bf16
    assert with_draft["ranks"][0]["kv_bytes_per_token"] == plain["ranks"][0]["kv_bytes_per_token"] + draft_per_token
    assert with_draft["ranks"][0]["weights"] > plain["ranks"][0]["weights"]
    assert with_draft["num_blocks"] < plain["num_blocks"]
