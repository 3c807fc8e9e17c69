"""Speculative decoding on a GPU (the gpu tier: `pytest -m gpu`, skipped without CUDA), fp32 on the Triton
backend: verify steps of 1 + k tokens per request replay the mixed-step CUDA graphs and give the tokens of
eager steps and of a run without speculation; a draft model (the target itself) and an EAGLE-3 head (which
runs its target eagerly) give the tokens of a run without them.

fp32, not the served bf16: a verify step runs its GEMMs and attention over other row counts than a decode
step, and in bf16 that rounding difference decides a near-tie now and then (a run once split at the 48th
token of a prompt), which says nothing about verification. fp32's differences are far below this model's
top-2 margins. Every step drafts (the budget is pinned on): the budget has its own tests."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from kvserve.spec_decode.draft_budget import BudgetChoice
from tests.eagle3_reference import save_random_head
from tests.gpu_tier import ENGINE_TIER, GPU_TEST_KV_CACHE_BYTES

pytestmark = ENGINE_TIER

VOCAB = 32000
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpu-spec-llama")
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(path)
    return str(path)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    # Repeated stretches: the lookups find drafts, the random model follows them part of the way.
    return [[rng.randrange(3, VOCAB) for _ in range(12)] * 4 for _ in range(4)]


def _run(path, spec=None, **kw):
    """(tokens, drafter totals or None, mixed-graph replays that verified drafts)."""
    from kvserve import LLM, SamplingParams

    llm = LLM(path, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=GPU_TEST_KV_CACHE_BYTES,
              skip_tokenizer_init=True, attention_backend="triton",
              **({"speculative_config": spec} if spec else {}), **kw)
    engine = llm.llm_engine
    verify_replays = [0]
    graphs = engine.runner.graph_runner
    if graphs is not None:
        run_mixed = graphs.run_mixed

        def counting(input_ids, positions, slot_mapping, query_start_loc, seq_lens, *rest):
            if rest[1].size > seq_lens.size:  # more sampled rows than requests: drafts are verified
                verify_replays[0] += 1
            return run_mixed(input_ids, positions, slot_mapping, query_start_loc, seq_lens, *rest)

        graphs.run_mixed = counting
    if engine.drafter is not None:  # every step drafts k tokens per request
        pinned = BudgetChoice(engine.drafter.spec.num_speculative_tokens, "on")
        engine.drafter.budget.choose = lambda batch_size: pinned
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    totals = engine.drafter.totals.copy() if engine.drafter is not None else None
    if graphs is not None:
        del graphs.run_mixed  # the class's method again: no cycle through the counter keeps the graphs alive
    engine.shutdown()
    del llm, engine, graphs, outs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, totals, verify_replays[0]


def test_verify_steps_replay_graphs_and_match_eager_and_no_speculation(target_dir):
    plain, _, _ = _run(target_dir)
    tokens, totals, replays = _run(target_dir, NGRAM)
    eager, _, _ = _run(target_dir, NGRAM, enforce_eager=True)
    assert tokens == plain == eager
    assert totals.num_drafts > 0 and replays > 0


def test_draft_model_and_eagle3_on_gpu_match_no_speculation(target_dir, tmp_path):
    plain, _, _ = _run(target_dir)
    tokens, totals, _ = _run(target_dir, {"method": "draft_model", "model": target_dir, "num_speculative_tokens": 3})
    assert tokens == plain and totals.num_accepted_tokens > 0  # the target as its own draft is mostly right
    save_random_head(tmp_path, 512, 8, 2, 1024, VOCAB, 500, [1, 2, 3])
    tokens, totals, _ = _run(target_dir, {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3})
    assert tokens == plain and totals.num_drafts > 0
