"""Prometheus metrics under vLLM's names (prefix `kvserve:`), and the periodic throughput log line.

Each server owns its own CollectorRegistry (never prometheus_client's global one), so two engines in one
process, as in tests, do not collide. Everything here is called on the asyncio thread, never inside the
step loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger("kvserve.metrics")

PREFIX = "kvserve:"

# vLLM's buckets, so dashboards built for it read ours the same way.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
# The draft budget's reasons (spec_decode/draft_budget.py BudgetChoice.reason).
SPEC_DECODE_REASONS = ("on", "probe", "batch size", "draft cost", "acceptance")
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


@dataclass
class FinishedRequest:
    finished_reason: str
    e2e_latency: float
    queue_time: float | None
    time_per_output_token: float | None


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        lv = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(**lv)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(**lv)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(**lv)

        self.num_requests_running = gauge("num_requests_running", "Number of requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV cache usage: 1 means 100 percent.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens.")
        # By mode (recompute | swap): what each preemption cost differs by orders of magnitude.
        self._num_preemptions = Counter(PREFIX + "num_preemptions", "Cumulative number of preemptions, by mode.",
                                        labels + ["mode"], registry=self.registry)
        self.num_preemptions = {mode: self._num_preemptions.labels(model_name=model_name, mode=mode)
                                for mode in ("recompute", "swap")}
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._request_success = Counter(
            PREFIX + "request_success", "Count of finished requests, by finish reason.",
            labels + ["finished_reason"], registry=self.registry)
        self._model_name = model_name
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token in seconds.", _TTFT_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Time per output token in seconds.", _TPOT_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "End to end request latency in seconds.", _LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time spent waiting before first scheduled, in seconds.", _LATENCY_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Number of tokens per engine step.", _ITERATION_TOKEN_BUCKETS)

        # Speculative decoding, under vLLM's names (a counter of drafts, draft tokens, accepted tokens, and
        # accepted tokens by draft position); plus the draft tokens per request the budget chose last.
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Number of accepted tokens.")
        self._spec_decode_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            labels + ["position"], registry=self.registry)
        self.spec_decode_num_speculative_tokens = gauge(
            "spec_decode_num_speculative_tokens",
            "Draft tokens per request in the latest step: the budget's choice from batch size and acceptance.")
        # Why drafts are on or off now: 1 on the draft budget's current reason, 0 on the others.
        self._spec_decode_state = Gauge(
            PREFIX + "spec_decode_state", "Speculative decoding now: 1 on the draft budget's reason (on, probe, or "
            "turned down by batch size, draft cost or acceptance).", labels + ["reason"], registry=self.registry)
        self._spec_decode_totals = None  # the last SpecDecodeStats seen

        # The engine reports cumulative totals; counters advance by the difference.
        self._last_totals = {"queries": 0, "hits": 0, "preemptions_recompute": 0, "preemptions_swap": 0}
        self.log = ThroughputLog()

    # ---- what the async engine reports -----------------------------------------------------------
    def observe_engine(self, stats) -> None:
        """`stats`: the engine's EngineStats after a step or after applying commands."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        by_mode = getattr(stats, "num_preemptions_by_mode", None) or {"recompute": stats.num_preemptions}
        for key, value, counter in (
            ("queries", stats.prefix_cache_queries, self.prefix_cache_queries),
            ("hits", stats.prefix_cache_hits, self.prefix_cache_hits),
            *((f"preemptions_{mode}", n, self.num_preemptions[mode]) for mode, n in by_mode.items()),
        ):
            if value > self._last_totals[key]:
                counter.inc(value - self._last_totals[key])
            self._last_totals[key] = value
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:
            self._observe_spec_decode(spec, stats.num_speculative_tokens, getattr(stats, "speculation_reason", None))
        self.log.latest = stats

    def _observe_spec_decode(self, totals, num_speculative_tokens: int | None, reason: str | None = None) -> None:
        new = totals.since(self._spec_decode_totals or SpecDecodeStats())
        self._spec_decode_totals = totals
        if new.num_drafts > 0:
            self.spec_decode_num_drafts.inc(new.num_drafts)
            self.spec_decode_num_draft_tokens.inc(new.num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(new.num_accepted_tokens)
            for pos, n in enumerate(new.accepted_per_pos):
                if n:
                    self._spec_decode_per_pos.labels(model_name=self._model_name, position=str(pos)).inc(n)
        if num_speculative_tokens is not None:
            self.spec_decode_num_speculative_tokens.set(num_speculative_tokens)
        if reason is not None:
            for r in SPEC_DECODE_REASONS:
                self._spec_decode_state.labels(model_name=self._model_name, reason=r).set(1 if r == reason else 0)

    def observe_iteration(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """As vLLM v1: a request's prompt tokens count in the step that produced its first token."""
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generation_tokens:
            self.generation_tokens.inc(num_generation_tokens)
        if num_prompt_tokens or num_generation_tokens:
            self.iteration_tokens.observe(num_prompt_tokens + num_generation_tokens)
        self.log.prompt_tokens += num_prompt_tokens
        self.log.generation_tokens += num_generation_tokens

    def observe_first_token(self, ttft: float) -> None:
        self.time_to_first_token.observe(ttft)

    def observe_finished(self, req: FinishedRequest) -> None:
        self._request_success.labels(model_name=self._model_name, finished_reason=req.finished_reason).inc()
        self.e2e_request_latency.observe(req.e2e_latency)
        if req.queue_time is not None:
            self.request_queue_time.observe(req.queue_time)
        if req.time_per_output_token is not None:
            self.time_per_output_token.observe(req.time_per_output_token)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ThroughputLog:
    """vLLM's periodic line: throughput since the previous line, queue sizes, KV usage, prefix hits."""

    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.latest = None  # EngineStats
        self._last_time = time.monotonic()
        self._last_queries = 0
        self._last_hits = 0
        self._last_spec_decode = None  # SpecDecodeStats totals at the previous line

    def maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-9)
        stats = self.latest
        busy = self.prompt_tokens or self.generation_tokens or (stats and (stats.num_running or stats.num_waiting))
        if busy and stats is not None:
            queries = stats.prefix_cache_queries - self._last_queries
            hits = stats.prefix_cache_hits - self._last_hits
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
                "Preemptions: %d",
                self.prompt_tokens / elapsed, self.generation_tokens / elapsed, stats.num_running,
                stats.num_waiting, stats.kv_cache_usage * 100, 100 * hits / queries if queries else 0.0,
                stats.num_preemptions,
            )
            spec = getattr(stats, "spec_decode", None)
            if spec is not None:
                reason = getattr(stats, "speculation_reason", None)
                turned = f" (turned down: {reason})" if reason not in (None, "on", "probe") else ""
                logger.info("SpecDecoding metrics: %s; draft tokens per request now: %s%s",
                            spec.since(self._last_spec_decode or SpecDecodeStats()).log_text(),
                            stats.num_speculative_tokens, turned)
        if stats is not None:
            self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            self._last_spec_decode = getattr(stats, "spec_decode", None)
        self.prompt_tokens = self.generation_tokens = 0
        self._last_time = now
