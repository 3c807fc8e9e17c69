"""Out of memory at start-up names the phase, the numbers and one flag; out of memory in a step fails that
step's requests and the engine serves the next one. Failures are injected (KVSERVE_INJECT_OOM) or come
from a memory budget."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs
from kvserve.engine.step_errors import StepOutOfMemoryError
from kvserve.worker import memory
from kvserve.worker.memory import StartupMemoryError
from kvserve.sizing.memory_plan import GiB
from tests.conftest import random_prompts
from tests.server_utils import RemoteServer

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
W1_CONFIG_DIR = Path(__file__).resolve().parents[2] / "examples" / "configs" / "llama-3.1-8b"


@pytest.fixture
def llama(tiny_model_factory):
    return tiny_model_factory("llama")[0]


@pytest.mark.parametrize("key,phase,flag", [
    ("load_weights", memory.LOADING_WEIGHTS, "--tensor-parallel-size"),
    ("profile", memory.PROFILING, "--max-num-batched-tokens"),
    ("kv_cache", memory.ALLOCATING_KV, "--kv-cache-memory-bytes"),
    ("cuda_graphs", memory.CAPTURING_GRAPHS, "--enforce-eager"),
])
def test_startup_oom_names_phase_numbers_and_flag(llama, monkeypatch, key, phase, flag):
    monkeypatch.setenv(memory.INJECT_ENV, key)
    with pytest.raises(StartupMemoryError) as info:
        LLM(llama, device="cpu", max_model_len=256, kv_cache_memory_bytes=4 << 20, max_num_seqs=8)
    err = info.value
    assert err.phase == phase and err.flag == flag
    text = str(err)
    assert f"Out of memory while {phase}" in text and f"Try {flag}" in text
    assert "available" in text and "held by other processes" in text
    if flag == "--max-num-batched-tokens":
        assert err.value == 4096  # half of the default 8192
    if flag == "--kv-cache-memory-bytes":
        assert err.needed > 0 and err.value > 0


def test_kv_budget_too_small_names_the_largest_max_model_len_that_fits(llama):
    # 2 layers x 2 (K, V) x 2 KV heads x 16 dims x 4 B = 512 B per token: 64 KiB = 128 tokens = 8 blocks.
    with pytest.raises(StartupMemoryError) as info:
        LLM(llama, device="cpu", max_model_len=512, kv_cache_memory_bytes=64 * 1024)
    err = info.value
    assert (err.phase, err.flag, err.value) == (memory.ALLOCATING_KV, "--max-model-len", 128)
    # The suggested value starts.
    llm = LLM(llama, device="cpu", max_model_len=err.value, kv_cache_memory_bytes=64 * 1024)
    assert llm.llm_engine.kv_cache_manager.num_blocks == 8


def _startup_on_a_gpu_of(total_gib: float, model=W1_CONFIG_DIR, **flags) -> memory.StartupMemory:
    """A StartupMemory that saw a GPU of `total_gib` with 0.5 GiB held by others (a memory budget)."""
    config = EngineArgs(model=str(model), load_format="dummy", skip_tokenizer_init=True, device="cpu",
                        dtype="bfloat16", max_model_len=4096, **flags).create_engine_config()
    startup = memory.StartupMemory(config)
    startup.on_gpu, startup.total, startup.free_at_start = True, int(total_gib * GiB), int((total_gib - 0.5) * GiB)
    startup.others = int(0.5 * GiB)
    return startup


def test_weights_over_budget_names_the_smallest_tp():
    # Llama-3.1-8B in bf16: 8,030,261,248 parameters x 2 B = 14.96 GiB. A 16 GiB GPU at 0.9 with 0.5 GiB
    # held by others gives 13.9 GiB: no. tp 2 halves everything but the embedding and head rows
    # (2 x 128256 x 4096 / 2 each): 7.48 GiB per GPU: yes.
    startup = _startup_on_a_gpu_of(16)
    with pytest.raises(StartupMemoryError) as info:
        startup.check_weights_fit()
    err = info.value
    assert err.phase == memory.LOADING_WEIGHTS and (err.flag, err.value) == ("--tensor-parallel-size", 2)
    assert err.needed == 8_030_261_248 * 2
    assert "14.96 GiB" in str(err) and "0.50 GiB is held by other processes" in str(err)
    # A big enough GPU passes.
    _startup_on_a_gpu_of(24).check_weights_fit()


def test_no_kv_left_after_profiling_names_a_smaller_step_budget():
    startup = _startup_on_a_gpu_of(24)
    per_block = memory.kv_bytes_per_block(startup.config)  # 16 tokens x 128 KiB = 2 MiB
    one_request = 4096 // 16 * per_block  # 512 MiB
    weights = 14 * GiB
    # 24 x 0.9 = 21.6 GiB - 0.5 others - 14 weights = 7.1 GiB: activations of 7.3 GiB leave -0.2 GiB.
    activations = int(7.3 * GiB)
    budget = int(24 * GiB * 0.9)
    kv = budget - startup.others - weights - activations
    with pytest.raises(StartupMemoryError) as info:
        startup._raise_no_kv(kv, per_block, weights, activations, budget, 0)
    err = info.value
    # Cutting the step to a fraction 1 - (one_request - kv) / activations of 8192 tokens frees enough:
    # 8192 x (1 - 0.7 / 7.3) = 7406 tokens, rounded down to a power of two.
    assert kv < 0 and (one_request - kv) / GiB == pytest.approx(0.7, abs=0.01)
    assert err.phase == memory.PROFILING and (err.flag, err.value) == ("--max-num-batched-tokens", 4096)


def test_runtime_oom_fails_the_step_and_the_engine_goes_on(llama, monkeypatch, caplog):
    llm = LLM(llama, device="cpu", max_model_len=256, kv_cache_memory_bytes=4 << 20, max_num_seqs=8)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 5, 20, seed=3)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    memory.reset_oom_injection()
    monkeypatch.setenv(memory.INJECT_ENV, "step")
    with caplog.at_level(logging.ERROR, logger="kvserve.engine.llm_engine"):
        with pytest.raises(StepOutOfMemoryError) as info:
            llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(info.value.request_ids) == 3
    assert "ran out of memory" in str(info.value) and "--max-num-batched-tokens" in str(info.value)
    assert any("Out of memory in a step" in r.message and "lower --max-num-batched-tokens" in r.message
               for r in caplog.records)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.kv_cache_manager.check_invariants()
    assert engine.kv_cache_manager.usage() == 0.0
    # The next requests are served, with the same tokens.
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


def test_server_runtime_oom_is_a_500_then_preemptions_are_reported(llama, monkeypatch):
    """One server: an injected OOM fails its request with a 500 and the next succeeds; then a load that
    preempts (12 KV blocks) reports num_preemptions in usage and in the metric by mode."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv(memory.INJECT_ENV, "step")
    srv = RemoteServer(llama, "--max-model-len", "128", "--max-num-seqs", "8", "--dtype", "float32",
                       "--num-gpu-blocks-override", "12")
    try:
        body = {"model": llama, "prompt": "Hello there", "max_tokens": 4}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500
        error = r.json()["error"]
        assert "ran out of memory" in error["message"] and "--max-num-" in error["message"]
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        assert "Out of memory in a step" in srv.log_tail()

        def complete(numbered):
            i, prompt = numbered
            body = {"model": llama, "prompt": prompt, "max_tokens": 20, "ignore_eos": True}
            if i % 2:  # every other one streams: its final usage chunk reports the count as well
                body.update(stream=True, stream_options={"include_usage": True})
                lines = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).text.splitlines()
                chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
                return chunks[-1]["usage"]
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()["usage"]

        # 8 requests of 44 + 20 tokens (4 blocks each) at once: any 4 running need 16 of the 12 blocks.
        with ThreadPoolExecutor(8) as pool:
            usages = list(pool.map(complete, enumerate(random_prompts(8, 44, 44, seed=4))))
        assert all(u["completion_tokens"] == 20 for u in usages)
        preempted = sum(u.get("num_preemptions", 0) for u in usages)
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        counted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("kvserve:num_preemptions_total{"))
        assert preempted > 0 and counted == preempted
        assert 'mode="recompute"' in metrics
    finally:
        srv.stop()
