"""Swap preemption end to end on CPU: swap and auto give the tokens recompute (and HF) gives under heavy
preemption; each preemption is logged and counted by mode; finished requests report their preemptions."""

from __future__ import annotations

import logging

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.metrics import EngineMetrics
from kvserve.engine.preemption_log import PreemptionLog
from kvserve.core.scheduler import PreemptionEvent
from tests.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = random_prompts(8, 40, 60, seed=4)
# 12 blocks of 16 = 192 tokens for 8 requests of ~70 tokens each: preemption is unavoidable.
HEAVY = dict(num_gpu_blocks_override=12, max_model_len=128, device="cpu")


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(llama):
    path, hf_model = llama
    return hf_greedy(hf_model, PROMPTS, GREEDY.max_tokens)


def _run(path, **flags):
    llm = LLM(path, **HEAVY, **flags)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs, llm.llm_engine


@pytest.mark.parametrize("flags", [
    dict(preemption_mode="recompute"),
    dict(preemption_mode="swap", swap_space=0.01),
    dict(preemption_mode="swap", swap_space=2 * 8192 / 2**30),  # room for 2 blocks: mostly falls back
    dict(preemption_mode="auto", swap_space=0.01),
], ids=["recompute", "swap", "swap-full", "auto"])
def test_same_tokens_as_hf_under_heavy_preemption(llama, reference, flags, caplog):
    path, _ = llama
    with caplog.at_level(logging.INFO, logger="kvserve.preemption"):
        tokens, outs, engine = _run(path, **flags)
    assert tokens == reference
    stats = engine.get_stats()
    by_mode = stats.num_preemptions_by_mode
    assert stats.num_preemptions > 0 and sum(by_mode.values()) == stats.num_preemptions
    assert sum(o.num_preemptions for o in outs) == stats.num_preemptions  # each request reports its own
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 12 and kv.swap_space.num_free_blocks == kv.swap_space.num_blocks
    mode = flags["preemption_mode"]
    if mode == "recompute":
        assert by_mode["swap"] == 0
    elif flags["swap_space"] == 0.01:
        assert kv.swap_space.num_blocks == int(0.01 * 2**30) // 8192  # 2 layers x 2 x 2 heads x 16 x 4 B x 16
        if mode == "swap":
            assert by_mode["swap"] == stats.num_preemptions
    else:
        assert kv.swap_space.num_blocks == 2 and by_mode["recompute"] > 0
    lines = [r.message for r in caplog.records if r.message.startswith("Preempted request")]
    assert lines and all("KV cache usage" in line and "running" in line and "waiting" in line for line in lines)
    if by_mode["swap"]:
        assert any("(swap): " in line and "blocks" in line and "swapped to CPU" in line for line in lines)


def test_swap_flags_are_checked():
    with pytest.raises(ValueError, match="--swap-space 4"):
        LLM(None, preemption_mode="swap")
    with pytest.raises(ValueError, match="--preemption-mode"):
        LLM(None, preemption_mode="sometimes", swap_space=1)
    with pytest.raises(ValueError, match="--swap-space"):
        LLM(None, swap_space=-1)


def test_preemption_log_is_rate_limited_and_warns_with_advice(caplog):
    now = [0.0]
    log = PreemptionLog(max_num_seqs=64, gpu_memory_utilization=0.8, preemption_mode="recompute",
                        lines_per_window=3, window_seconds=10, warn_per_minute=5, clock=lambda: now[0])
    event = PreemptionEvent("r1", "recompute", 120, 8, 0.97, 12, 30)
    with caplog.at_level(logging.INFO, logger="kvserve.preemption"):
        log.report([event] * 4)
        now[0] = 11.0
        log.report([event] * 4)
    messages = [r.message for r in caplog.records]
    lines = [m for m in messages if m.startswith("Preempted request r1 (recompute): 120 tokens to recompute")]
    assert len(lines) == 6  # 3 per 10-second window
    assert any("1 more preemptions" in m for m in messages)
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # at most one a minute
    assert ("--gpu-memory-utilization 0.85" in warnings[0] and "--max-num-seqs 12" in warnings[0]
            and "--preemption-mode auto" in warnings[0])
    assert warnings[0].index("--gpu-memory-utilization") < warnings[0].index("--max-num-seqs")  # tuning order


def test_num_preemptions_metric_has_a_mode_label():
    from types import SimpleNamespace

    metrics = EngineMetrics("m")
    stats = SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                            prefix_cache_hits=0, num_preemptions=5, num_preemptions_by_mode={"recompute": 3, "swap": 2})
    metrics.observe_engine(stats)
    text = metrics.render().decode()
    assert 'kvserve:num_preemptions_total{mode="recompute",model_name="m"} 3.0' in text
    assert 'kvserve:num_preemptions_total{mode="swap",model_name="m"} 2.0' in text
