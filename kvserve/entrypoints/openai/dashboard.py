"""`/dashboard`: a live page of the KV cache (plain HTML + JavaScript, no build step) and its JSON feed.

GET /dashboard           the page. It holds no data, so it loads without the API key; the page then asks
                         for the data with `Authorization: Bearer KEY` (from `#key=...` in the URL or a prompt).
GET /dashboard/snapshot  JSON, under the same API-key and loading/draining rules as /v1: the engine core's
                         latest KV snapshot (engine/kv_snapshot.py: bounded size, whatever the cache size), the
                         server's metric values read from the same registry /metrics renders (so the page and
                         /metrics agree), and a short history for the sparklines.
"""

from __future__ import annotations

import collections
import time
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from kvserve.engine.metrics import PREFIX

DASHBOARD_PAGE = "/dashboard"
HISTORY_POINTS = 120
HISTORY_MIN_SPACING_S = 0.5

# JSON key -> Prometheus sample name (counters are exported with _total).
METRIC_SAMPLES = {
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "prompt_tokens": "prompt_tokens_total",
    "generation_tokens": "generation_tokens_total",
    "prefix_cache_queries": "prefix_cache_queries_total",
    "prefix_cache_hits": "prefix_cache_hits_total",
    "num_preemptions": "num_preemptions_total",
    "spec_decode_num_drafts": "spec_decode_num_drafts_total",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_speculative_tokens": "spec_decode_num_speculative_tokens",
}


class DashboardFeed:
    """The API-process side: metric values, and throughput / KV-usage history for the sparklines."""

    def __init__(self, metrics, model_name: str):
        self.metrics = metrics
        self.labels = {"model_name": model_name}
        self.history: collections.deque = collections.deque(maxlen=HISTORY_POINTS)
        self._last: tuple[float, float, float] | None = None  # time, prompt total, generation total

    def metric_values(self) -> dict:
        """Each sample summed over the label sets beyond model_name (num_preemptions has a `mode` label), as
        a sum over /metrics' series would give."""
        wanted = {PREFIX + sample: key for key, sample in METRIC_SAMPLES.items()}
        values = dict.fromkeys(METRIC_SAMPLES, 0.0)
        for family in self.metrics.registry.collect():
            for s in family.samples:
                key = wanted.get(s.name)
                if key is not None and all(s.labels.get(k) == v for k, v in self.labels.items()):
                    values[key] += s.value
        return values

    def speculation(self) -> dict | None:
        """Speculative decoding at a glance (None when it is not configured): mean acceptance length since
        start (tokens per verify step of a request with drafts) and the draft budget's reason now."""
        m = self.metric_values()
        reason = None
        for family in self.metrics.registry.collect():
            for s in family.samples:
                if s.name == PREFIX + "spec_decode_state" and s.value == 1 and \
                        s.labels.get("model_name") == self.labels["model_name"]:
                    reason = s.labels["reason"]
        if reason is None:
            return None
        drafts = m["spec_decode_num_drafts"]
        return {"acceptance_length": 1 + m["spec_decode_num_accepted_tokens"] / drafts if drafts else None,
                "num_speculative_tokens": int(m["spec_decode_num_speculative_tokens"]), "reason": reason}

    def sample(self, _snapshot: dict | None = None) -> None:
        """One history point: token throughput since the previous point, and KV usage now."""
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < HISTORY_MIN_SPACING_S:
            return
        m = self.metric_values()
        if self._last is not None:
            dt = now - self._last[0]
            self.history.append({
                "t": time.time(),
                "prompt_tps": (m["prompt_tokens"] - self._last[1]) / dt,
                "generation_tps": (m["generation_tokens"] - self._last[2]) / dt,
                "kv_usage": m["kv_cache_usage_perc"],
            })
        self._last = (now, m["prompt_tokens"], m["generation_tokens"])

    def payload(self, engine) -> dict:
        self.sample()
        return {
            "model": self.labels["model_name"],
            "metrics": self.metric_values(),
            "speculation": self.speculation(),
            "snapshot": getattr(engine, "kv_snapshot", None),
            "history": list(self.history),
        }


def add_dashboard_routes(app: FastAPI, engine, metrics, model_name: str) -> DashboardFeed:
    feed = DashboardFeed(metrics, model_name)
    listeners = getattr(engine, "kv_snapshot_listeners", None)  # test doubles of the engine may lack it
    if listeners is not None:
        listeners.append(feed.sample)
    page = resources.files("kvserve.entrypoints.openai").joinpath("dashboard.html").read_text()

    @app.get(DASHBOARD_PAGE, response_class=HTMLResponse)
    async def dashboard_page():
        return HTMLResponse(page)

    @app.get(DASHBOARD_PAGE + "/snapshot")
    async def dashboard_snapshot():
        return feed.payload(engine)

    return feed
