"""docs/grafana-dashboard.json reads only metrics the server exports (names taken from the metrics module's
own registry, with every histogram and counter observed so each sample name exists)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvserve.engine.metrics import EngineMetrics, FinishedRequest

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


def exported_sample_names() -> set[str]:
    m = EngineMetrics("m")
    m.observe_iteration(3, 2)
    m.observe_first_token(0.1)
    m.observe_finished(FinishedRequest("stop", 1.0, 0.1, 0.01))
    names = set()
    for family in m.registry.collect():
        names.update(s.name for s in family.samples)
    return names


def dashboard_exprs() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in data["panels"] for t in p["targets"]]


def test_dashboard_uses_only_exported_metrics():
    exported = exported_sample_names()
    used = {name for expr in dashboard_exprs() for name in re.findall(r"kvserve:[A-Za-z0-9_:]+", expr)}
    assert used, "no kvserve metrics in the dashboard"
    assert used <= exported, f"not exported by kvserve: {sorted(used - exported)}"
    # The panels are all there.
    for needed in ("kvserve:time_to_first_token_seconds_bucket", "kvserve:time_per_output_token_seconds_bucket",
                   "kvserve:e2e_request_latency_seconds_bucket", "kvserve:kv_cache_usage_perc",
                   "kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:num_preemptions_total",
                   "kvserve:prefix_cache_hits_total", "kvserve:prefix_cache_queries_total"):
        assert needed in used, needed


def test_dashboard_is_importable_json():
    data = json.loads(DASHBOARD.read_text())
    assert data["uid"] and data["title"] and data["schemaVersion"] >= 30
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    for p in data["panels"]:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert all(t["refId"] and t["expr"] for t in p["targets"])
        # Every query filters by the model_name variable, so one Grafana serves several kvserve servers.
        assert all('model_name=~"$model_name"' in t["expr"] for t in p["targets"])
