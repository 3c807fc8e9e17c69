"""Bad input gets a ValueError that says what to change; the engine keeps working afterwards."""

from __future__ import annotations

import pytest

from kvserve import LLM, EngineArgs, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    return LLM(path, max_model_len=128, kv_cache_memory_bytes=16 << 20)


def test_too_long_prompt_names_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": list(range(3, 3 + 129))}, GREEDY, use_tqdm=False)
    # Nothing was left behind, and the engine still serves.
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_batch_with_one_bad_prompt_adds_nothing(llm):
    prompts = [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": list(range(200))}]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv_cache_manager.usage() == 0


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**9]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must be"):
        llm.generate([3.5], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
        (dict(block_size=12), "--block-size"),
        (dict(dtype="int3"), "--dtype"),
        (dict(max_num_seqs=0), "--max-num-seqs"),
        (dict(load_format="pickle"), "--load-format"),
        (dict(tensor_parallel_size=0), "--tensor-parallel-size"),
        (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "--distributed-executor-backend"),
    ],
)
def test_invalid_engine_args(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        EngineArgs(**kwargs)


def test_invalid_combinations(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(path, max_model_len=4096)
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        LLM(path, max_model_len=512, enable_chunked_prefill=False, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="--max-num-seqs"):
        LLM(path, max_num_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="Unknown engine argument"):
        LLM(path, max_modle_len=5)
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model")


def test_kv_cache_too_small_for_max_model_len(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    # 2 layers * 2 (K, V) * 2 kv heads * 16 dims * 4 bytes = 512 B per token: 64 KiB holds 128 tokens.
    with pytest.raises(ValueError) as err:
        LLM(path, max_model_len=512, kv_cache_memory_bytes=64 << 10)
    msg = str(err.value)
    assert "max seq len (512)" in msg and "--max-model-len 128" in msg
    assert "--kv-cache-memory-bytes" in msg and "GiB" in msg


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
