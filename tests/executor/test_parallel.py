"""Tensor and pipeline parallelism on CPU (gloo, one process per rank): fp32 greedy tokens identical to
HF transformers and to the single-process engine, with chunked prefill, a prefix-cache hit and a
preemption in the same run. Tiny checkpoints: one with fewer KV heads than TP ranks (KV heads replicated),
one with tied embeddings (vocab-parallel embedding doubling as the LM head)."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs
from tests.conftest import TINY_VOCAB, hf_greedy, random_prompts

MAX_TOKENS = 6


def _build(tmp_path_factory, smol_tokenizer, name: str, **overrides):
    import transformers

    cfg = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, initializer_range=0.1)
    cfg.update(overrides)
    torch.manual_seed(4321)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**cfg)).eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory, smol_tokenizer):
    return _build(tmp_path_factory, smol_tokenizer, "tiny-1kv", num_key_value_heads=1)


@pytest.fixture(scope="module")
def tied(tmp_path_factory, smol_tokenizer):
    return _build(tmp_path_factory, smol_tokenizer, "tiny-tied", tie_word_embeddings=True)


def _prompts() -> list[list[int]]:
    # 0 and 1 share two full blocks (a prefix-cache hit for 1); 40+ tokens exceed the 32-token budget
    # (chunked prefill); 5 blocks of 16 cannot hold all three at once (a preemption).
    base = random_prompts(3, 36, 44, seed=7)
    return [base[0], base[0][:32] + base[1][:9], base[2]]


ENGINE = dict(max_model_len=80, block_size=16, num_gpu_blocks_override=5, max_num_batched_tokens=32,
              max_num_seqs=3, enable_chunked_prefill=True, enable_prefix_caching=True)


_SINGLE: dict = {}


def _single(path: str):
    if path not in _SINGLE:
        _SINGLE[path] = _run(path)
    return _SINGLE[path]


def _run(path: str, **parallel):
    llm = LLM(path, **ENGINE, **parallel)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("model_name,parallel", [
    ("one_kv_head", dict(tensor_parallel_size=2)),
    ("tied", dict(tensor_parallel_size=2)),
    ("tied", dict(pipeline_parallel_size=2, pp_layer_partition="1,2")),
    ("one_kv_head", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
], ids=["tp2-kv-replicated", "tp2-tied", "pp2-uneven-tied", "tp2xpp2"])
def test_parallel_greedy_matches_hf_and_single_process(request, model_name, parallel):
    path, hf_model = request.getfixturevalue(model_name)
    expected = hf_greedy(hf_model, _prompts(), MAX_TOKENS)
    single, single_stats = _single(path)
    assert single == expected
    tokens, stats = _run(path, **parallel)
    assert tokens == expected
    # The features this run was built to exercise did happen, as in the single-process run.
    assert stats.prefix_cache_hits > 0 and single_stats.prefix_cache_hits > 0
    assert stats.num_preemptions > 0 and single_stats.num_preemptions > 0


def test_mp_executor_at_tp1_matches_uni(one_kv_head):
    path, _ = one_kv_head
    assert _run(path, distributed_executor_backend="mp")[0] == _single(path)[0]


@pytest.mark.parametrize("overrides,flag", [
    (dict(tensor_parallel_size=3), "--tensor-parallel-size 3"),  # 4 heads
    (dict(pipeline_parallel_size=4), "--pipeline-parallel-size 4"),  # 3 layers
    (dict(pipeline_parallel_size=2, pp_layer_partition="2,2"), "2,2"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "--distributed-executor-backend"),
], ids=["heads", "layers", "partition", "uni"])
def test_impossible_layouts_name_the_numbers_and_flag(tied, overrides, flag):
    path, _ = tied
    with pytest.raises(ValueError, match=flag.replace("-", r"\-") if flag.startswith("--") else flag):
        EngineArgs(model=path, **overrides).create_engine_config()
