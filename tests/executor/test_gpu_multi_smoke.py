"""benchmarks/gpu_multi.py, the multi-GPU benchmark, run on CPU (gloo) on a tiny model: the same code paths
as on GPUs (mp with TP=2, Ray with two nodes on this host for TP=2 x PP=2), and the communication timer's
numbers reach the results (calls counted per collective, seconds > 0 when on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _smoke(tmp_path, only: str) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_multi.py"), "--cpu-smoke", "--only", only,
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "### CPU smoke" in proc.stdout  # the table is printed last
    with open(tmp_path / "gpu_multi_cpu_smoke.json") as f:
        return json.load(f)["rows"]


def _check_row(r: dict, world: int, kinds: set[str]) -> None:
    assert r["status"] == "ok", r["status"]
    assert len(r["layout"]) == world and len(r["memory"]) == world
    w1 = r["w1"]
    assert w1["output_tokens"] == 6 * 8 and w1["output_tok_s"] > 0
    assert w1["steps"] > 0 and w1["eager_steps"] == w1["steps"]  # CPU: no CUDA graphs, every step eager
    assert kinds <= set(w1["comm_s_by_kind"]) and w1["comm_s_timed"] > 0
    assert w1["compute_ms_per_step"] + w1["comm_ms_per_step"] == pytest.approx(w1["ms_per_step"], abs=0.01)


def test_cpu_smoke_tp2_through_mp(tmp_path):
    rows = _smoke(tmp_path, "tiny_tp2")
    _check_row(rows["tiny_tp2"], 2, {"all_reduce", "all_gather"})


def test_cpu_smoke_tp2_pp2_on_two_ray_nodes(tmp_path):
    pytest.importorskip("ray")
    rows = _smoke(tmp_path, "tiny_tp2pp2_ray")
    r = rows["tiny_tp2pp2_ray"]
    _check_row(r, 4, {"all_reduce", "send", "recv"})
    stage_nodes = [{x["ray_node_id"] for x in r["layout"] if x["pp"] == stage} for stage in (0, 1)]
    assert all(len(nodes) == 1 for nodes in stage_nodes) and stage_nodes[0] != stage_nodes[1]


def test_comm_timer_tells_eager_steps_from_graph_replays():
    from kvserve.distributed.parallel_state import CommTimer

    timer = CommTimer()
    calls = []
    timer.begin_step()  # an eager step: the layers' all-reduces and the logits' all-gather from Python
    for _ in range(3):
        timer.time("all_reduce", False, calls.append, 1)
    timer.time("all_gather", False, calls.append, 2)
    timer.begin_step()  # a graph replay: only the logits' all-gather is a Python call
    timer.time("all_gather", False, calls.append, 2)
    timer.begin_step()  # a pipeline stage's step: a transfer
    timer.time("recv", False, calls.append, 3)
    stats = timer.summary()
    assert calls == [1, 1, 1, 2, 2, 3]  # every call ran
    assert stats["steps"] == 3 and stats["eager_steps"] == 2
    assert stats["calls"] == {"all_reduce": 3, "all_gather": 2, "recv": 1}
    assert set(stats["seconds"]) == {"all_reduce", "all_gather", "recv"}
    timer.reset()
    assert timer.summary()["steps"] == 0
