"""Speculative decoding on /metrics (vLLM's spec_decode names, kvserve: prefix) and in the periodic log line,
from the engine's running totals."""

from __future__ import annotations

import logging

from kvserve.engine.llm_engine import EngineStats
from kvserve.engine.metrics import EngineMetrics
from kvserve.spec_decode.stats import SpecDecodeStats


def _stats(spec: SpecDecodeStats | None, k: int | None = 3) -> EngineStats:
    return EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.1, prefix_cache_queries=0,
                       prefix_cache_hits=0, num_preemptions=0, spec_decode=spec, num_speculative_tokens=k)


def _value(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name) and not ln.startswith(name + "_created"))
    return float(line.rsplit(" ", 1)[1])


def test_counters_advance_by_what_the_totals_gained(caplog):
    metrics = EngineMetrics("m")
    totals = SpecDecodeStats()
    totals.observe(3, 2)
    metrics.observe_engine(_stats(totals.copy()))
    totals.observe(3, 3)
    totals.observe(2, 0)
    metrics.observe_engine(_stats(totals.copy(), k=1))
    text = metrics.render().decode()
    assert _value(text, "kvserve:spec_decode_num_drafts_total") == 3
    assert _value(text, "kvserve:spec_decode_num_draft_tokens_total") == 8
    assert _value(text, "kvserve:spec_decode_num_accepted_tokens_total") == 5
    assert _value(text, 'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}') == 2
    assert _value(text, 'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"}') == 1
    assert _value(text, "kvserve:spec_decode_num_speculative_tokens") == 1
    caplog.set_level(logging.INFO, logger="kvserve.metrics")
    metrics.log.generation_tokens = 10
    metrics.log.maybe_log()
    assert "SpecDecoding metrics: mean acceptance length 2.67" in caplog.text
    assert "draft tokens per request now: 1" in caplog.text
    caplog.clear()  # the next line counts only what came after this one
    totals.observe(1, 1)
    metrics.observe_engine(_stats(totals.copy()))
    metrics.log.generation_tokens = 2
    metrics.log.maybe_log()
    assert "mean acceptance length 2.00, draft acceptance rate 100.0%, accepted 1 of 1" in caplog.text


def test_nothing_about_speculation_when_it_is_off():
    metrics = EngineMetrics("m")
    metrics.observe_engine(_stats(None, None))
    assert _value(metrics.render().decode(), "kvserve:spec_decode_num_drafts_total") == 0


def test_the_turn_down_and_its_reason_are_visible(caplog):
    metrics = EngineMetrics("m")
    totals = SpecDecodeStats()
    totals.observe(3, 1)
    stats = _stats(totals.copy(), k=0)
    stats.speculation_reason = "batch size"
    metrics.observe_engine(stats)
    text = metrics.render().decode()
    assert _value(text, 'kvserve:spec_decode_state{model_name="m",reason="batch size"}') == 1
    assert _value(text, 'kvserve:spec_decode_state{model_name="m",reason="on"}') == 0
    caplog.set_level(logging.INFO, logger="kvserve.metrics")
    metrics.log.generation_tokens = 4
    metrics.log.maybe_log()
    assert "draft tokens per request now: 0 (turned down: batch size)" in caplog.text
    stats.speculation_reason = "on"
    metrics.observe_engine(stats)
    assert _value(metrics.render().decode(), 'kvserve:spec_decode_state{model_name="m",reason="on"}') == 1
