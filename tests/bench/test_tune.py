"""`kvserve tune`: real short trials on a tiny model, then the search order, SLO choice, resume and Ctrl-C
with a scripted benchmark (the tuner's logic, not the engine's speed)."""

from __future__ import annotations

import dataclasses
import json

from kvserve.bench import tune
from kvserve.entrypoints.cli import main

DATASET = ["--dataset", "random", "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--device", "cpu",
           "--disable-tqdm"]


def test_tune_runs_real_trials_and_prints_the_best_command(tiny_model_factory, capsys, tmp_path):
    path, _ = tiny_model_factory("llama")
    results = tmp_path / "tune.jsonl"
    assert main(["tune", path, *DATASET, "--max-trials", "2", "--results", str(results)]) == 0
    out = capsys.readouterr().out
    trials = [json.loads(line) for line in results.read_text().splitlines()]
    assert [t["stage"] for t in trials] == ["length", "coarse"]
    assert all(t["error"] is None and t["output_tokens_per_second"] > 0 for t in trials)
    # The length step sized max_model_len from the dataset: 16 + 4 tokens, rounded up to 256.
    assert trials[0]["settings"]["max_model_len"] == 256
    # The coarse grid starts at its smallest batch, capped at the number of requests.
    assert trials[1]["settings"]["max_num_seqs"] == 4 and trials[1]["settings"]["max_num_batched_tokens"] == 2048
    best = max(trials, key=lambda t: t["output_tokens_per_second"])
    assert "Trials (2):" in out and f"kvserve serve {path} " + tune._flags(best["settings"]) in out

    # Resuming with the same file runs nothing again.
    assert main(["tune", path, *DATASET, "--max-trials", "0", "--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert "Resuming: 2 trials" in out and "Trials (2):" in out
    assert len(results.read_text().splitlines()) == 2


def _scripted(monkeypatch, speed, interrupt_after: int | None = None):
    """run_trial replaced by a throughput function of the settings (and a fixed TTFT rule)."""
    calls = []

    def fake(engine_args, settings, requests, stage):
        if interrupt_after is not None and len(calls) == interrupt_after:
            raise KeyboardInterrupt
        calls.append((stage, dict(settings)))
        s = settings
        if s["max_num_seqs"] > 64 and s["max_num_batched_tokens"] == 16384:
            return tune.Trial(dict(s), stage, error="StartupMemoryError: Out of memory while profiling activations")
        tps = speed(s)
        return tune.Trial(dict(s), stage, tps, 2 * tps, ttft_p90_ms=s["max_num_seqs"] * 10.0, num_preemptions=0,
                          elapsed=1.0)

    monkeypatch.setattr(tune, "run_trial", fake)
    return calls


def test_search_order_coarse_then_fine_and_slo(tiny_model_factory, capsys, monkeypatch):
    path, _ = tiny_model_factory("llama")
    # Throughput peaks at 128 sequences and 8192 tokens; p90 TTFT is 10 ms per sequence.
    speed = lambda s: 1000 - abs(s["max_num_seqs"] - 128) - abs((s["max_num_batched_tokens"] or 8192) - 8192) / 100
    calls = _scripted(monkeypatch, speed)
    many = ["--dataset", "random", "--num-prompts", "600", "--input-len", "16", "--output-len", "4",
            "--device", "cpu", "--disable-tqdm"]
    assert main(["tune", path, *many]) == 0
    out = capsys.readouterr().out
    stages = [stage for stage, _ in calls]
    assert stages[0] == "length" and "utilization" not in stages  # CPU: no utilization step
    coarse = [(s["max_num_seqs"], s["max_num_batched_tokens"]) for st, s in calls if st == "coarse"]
    assert coarse == [(s, t) for s in (32, 64, 128, 256, 512) for t in (2048, 8192, 16384) if t >= s]
    fine = [(s["max_num_seqs"], s["max_num_batched_tokens"]) for st, s in calls if st == "fine"]
    assert (96, 6144) in fine and (192, 12288) in fine  # around the coarse best (128, 8192)
    assert "--max-num-seqs 128 --max-num-batched-tokens 8192" in out.splitlines()[-1]
    assert "StartupMemoryError" in out  # failed trials are listed, not fatal

    calls.clear()
    assert main(["tune", path, *many, "--slo-ttft-ms", "700"]) == 0
    out = capsys.readouterr().out
    # The best under 700 ms p90 TTFT has at most 70 sequences: 64 (coarse) or 48 (fine around it).
    assert "Best under p90 TTFT 700 ms" in out and "--max-num-seqs 64 " in out.splitlines()[-1]


def test_interrupt_prints_the_partial_table(tiny_model_factory, capsys, monkeypatch, tmp_path):
    path, _ = tiny_model_factory("llama")
    _scripted(monkeypatch, lambda s: 100.0 + s["max_num_seqs"], interrupt_after=3)
    results = tmp_path / "r.jsonl"
    assert main(["tune", path, *DATASET, "--results", str(results)]) == 130
    out = capsys.readouterr().out
    assert "Interrupted: the trials so far (3):" in out and "kvserve serve" in out
    assert len(results.read_text().splitlines()) == 3  # resumable from here


def test_resume_counts_the_budget_already_spent(tiny_model_factory, capsys, monkeypatch, tmp_path):
    path, _ = tiny_model_factory("llama")
    calls = _scripted(monkeypatch, lambda s: 100.0 + s["max_num_seqs"])
    results = tmp_path / "r.jsonl"
    # Two trials of a minute each were measured before an interruption: a 2.5-minute budget has no room left
    # for a third (it would end after the budget), a 10-minute one goes on.
    spent = [tune.Trial({"max_model_len": 64, "gpu_memory_utilization": 0.9, "max_num_seqs": s,
                         "max_num_batched_tokens": 2048}, "coarse", 100.0, 200.0, 1.0, 0, 1.0, None, 60.0)
             for s in (32, 64)]
    results.write_text("".join(json.dumps(dataclasses.asdict(t)) + "\n" for t in spent))
    assert main(["tune", path, *DATASET, "--budget-minutes", "2.5", "--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert "2.0 of the 2.5 budget minutes already spent" in out and calls == []
    assert main(["tune", path, *DATASET, "--budget-minutes", "10", "--max-trials", "1",
                 "--results", str(results)]) == 0
    assert len(calls) == 1
