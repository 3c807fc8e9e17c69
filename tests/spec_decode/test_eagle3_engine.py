"""--speculative-config eagle3 end to end, with an EAGLE-3 head in the public checkpoint format built here:
the drafts the engine proposes are the plain-torch reference head's (tests/eagle3_reference.py) over the
target's own hidden states, and greedy tokens are those of a run without speculation, with prefix hits,
chunked prefill, preemption and TP=2."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM
from kvserve.config import EngineArgs
from kvserve.worker.input_batch import RequestState
from tests.conftest import TINY_VOCAB
from tests.eagle3_reference import reference_chain, save_random_head
from tests.spec_decode.engine_settings import GREEDY, ROOMY, TIGHT, shared_prefix_prompts

K = 3
H, HEADS, KV_HEADS, INTER, DRAFT_VOCAB = 64, 4, 2, 96, 700
AUX_LAYERS = [1, 2, 3]


def _prompts() -> list[list[int]]:
    return shared_prefix_prompts(seed=11)


@pytest.fixture(scope="module")
def target(tmp_path_factory, smol_tokenizer):
    """A 4-layer tiny llama (so three different layers feed the head) and its HF model."""
    import transformers

    torch.manual_seed(21)
    cfg = transformers.LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=H, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path_factory.mktemp("eagle-target")
    hf.save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return str(path), hf


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """(path, state dict) of a random EAGLE-3 head in the public layout, without its own embedding."""
    path = tmp_path_factory.mktemp("eagle3-head")
    return str(path), save_random_head(path, H, HEADS, KV_HEADS, INTER, TINY_VOCAB, DRAFT_VOCAB, AUX_LAYERS)


def _run(path: str, engine: dict, spec: dict | None = None, record: list | None = None, **flags):
    llm = LLM(path, **{**engine, **flags}, **({"speculative_config": spec} if spec else {}))
    eng = llm.llm_engine
    try:
        if eng.drafter is not None:
            eng.drafter.budget.draft_step_cost = 0.0  # exactness is tested here, the budget on its own
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
        assert eng.kv_cache_manager.pool.num_free_blocks == eng.kv_cache_manager.num_blocks
        totals = eng.drafter.totals.copy() if eng.drafter is not None else None
        return [list(o.outputs[0].token_ids) for o in outs], eng.get_stats(), totals
    finally:
        eng.shutdown()


def _spec(head_path: str) -> dict:
    return {"method": "eagle3", "model": head_path, "num_speculative_tokens": K}


def test_engine_drafts_are_the_reference_heads(target, head, monkeypatch):
    """Every filled draft chain equals the reference head run over the target's hidden states of the
    request's tokens so far (HF's hidden_states[i]: the input of layer i). Without prefix caching: a
    shared block's last head position was written with the next token of the request that wrote it
    (a difference in acceptance only, which the tests below run with)."""
    (path, hf), (head_path, sd) = target, head
    filled = []
    original = RequestState.set_drafts

    def recording(self, tokens):
        first = self.start_pos + len(self.token_ids) - len(self.spec_token_ids)
        filled.append(((self.prompt_token_ids + self.output_token_ids)[:first], list(tokens)))
        original(self, tokens)

    monkeypatch.setattr(RequestState, "set_drafts", recording)
    engine = {**ROOMY, "enable_prefix_caching": False}
    tokens, _, totals = _run(path, engine, _spec(head_path))
    assert tokens == _run(path, engine)[0]
    assert len(filled) >= 10 and totals.num_drafts >= len(filled)
    sd_ref = {**sd, "embed_tokens.weight": hf.model.embed_tokens.weight.detach()}
    with torch.no_grad():
        bad = []
        for n, (context, drafts) in enumerate(filled):
            states = hf(torch.tensor([context]), output_hidden_states=True).hidden_states
            aux = [states[i][0, :-1] for i in AUX_LAYERS]
            ref = reference_chain(sd_ref, context[1:], aux, len(drafts), HEADS, KV_HEADS)
            if drafts != ref:
                bad.append((n, len(context), drafts, ref))
        assert not bad, bad


@pytest.mark.parametrize("flags", [dict(), dict(preemption_mode="swap", swap_space=0.01),
                                   dict(distributed_executor_backend="mp"), dict(tensor_parallel_size=2)],
                         ids=["uni-recompute", "uni-swap", "mp", "tp2"])
def test_eagle3_gives_the_tokens_of_a_run_without_it(target, head, flags):
    path, head_path = target[0], head[0]
    expected = _run(path, TIGHT)[0]
    tokens, stats, totals = _run(path, TIGHT, _spec(head_path), **flags)
    assert tokens == expected
    assert totals.num_drafts >= 5
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


def test_a_head_for_another_vocabulary_is_refused(target, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "intermediate_size": INTER, "num_hidden_layers": 1, "vocab_size": 1000,
        "draft_vocab_size": 100}))
    with pytest.raises(ValueError, match="--speculative-config: .*vocabulary \\(1000\\) is not the target's"):
        EngineArgs(model=target[0], speculative_config=_spec(str(tmp_path))).create_engine_config()


def test_a_head_saved_as_pytorch_model_bin_proposes_the_same_drafts(target, head, tmp_path):
    import shutil

    path, (head_path, sd) = target[0], head
    shutil.copy(f"{head_path}/config.json", tmp_path / "config.json")
    torch.save(sd, tmp_path / "pytorch_model.bin")
    tokens, _, totals = _run(path, ROOMY, _spec(str(tmp_path)))
    expected_tokens, _, expected_totals = _run(path, ROOMY, _spec(head_path))
    assert tokens == expected_tokens and totals == expected_totals and totals.num_drafts > 0


def test_the_heads_cache_shares_the_blocks_and_the_plan_counts_it(target, head):
    from kvserve.sizing import memory_plan
    from kvserve.worker import memory

    path, head_path = target[0], head[0]
    config = EngineArgs(model=path, **ROOMY, speculative_config=_spec(head_path)).create_engine_config()
    per_token = 1 * 2 * KV_HEADS * (H // HEADS) * 4  # one layer, K and V, fp32
    plan = memory_plan.make_plan(memory.plan_inputs(config, total_gpu_bytes=80 << 30))
    assert plan.ranks[0].draft_kv_bytes_per_token == per_token and plan.ranks[0].draft_weights > 0
    llm = LLM(path, **ROOMY, speculative_config=_spec(head_path))
    try:
        runner = llm.llm_engine.runner
        assert runner.kv_bytes_per_block() == memory.kv_bytes_per_block(config)
        assert runner.draft_runner.kv_caches[0].shape[1] == runner.kv_caches[0].shape[1] == 40
    finally:
        llm.llm_engine.shutdown()
