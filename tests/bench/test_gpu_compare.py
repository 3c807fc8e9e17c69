"""benchmarks/gpu_compare.py without a GPU: its requests are the vLLM bundle's (when the bundle is there to
compare with), and its table reads both engines' result files, with ratios the right way round."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks import gpu_compare

BUNDLE = Path(__file__).resolve().parents[3] / "shared" / "vllm" / "vllm_bench.py"


def test_requests_are_the_bundles():
    if not BUNDLE.exists():
        pytest.skip(f"the vLLM bundle's vllm_bench.py is not at {BUNDLE}")
    spec = importlib.util.spec_from_file_location("vllm_bench", BUNDLE)
    vllm_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_bench)  # defines the workloads; imports no vllm
    assert gpu_compare.w2_requests() == vllm_bench.make_long_workload()
    assert gpu_compare.long_prompt() == vllm_bench.make_latency_prompt(in_len=gpu_compare.LONG_PROMPT)[0]


def test_table_reads_both_engines_and_orients_ratios(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    vllm_bf16 = {"vllm_version": "0.26.0", "vllm_offline_out_tok_per_s": 1000.0, "bs1_out_tok_per_s": 200.0,
                 "output_tokens": 5, "expected_output_tokens": 5}
    vllm_w2 = {"elapsed_s": 30.0, "bs1_prefill_plus_1tok_s": 0.2, "bs1_out_tok_per_s": 180.0,
               "output_tokens": 5, "expected_output_tokens": 5}
    (tmp_path / "a" / "vllm_bench_bf16.json").write_text(json.dumps(vllm_bf16))
    (tmp_path / "b" / "vllm_bench_w2.json").write_text(json.dumps(vllm_w2))
    ours = {"kvserve_commit": "abc1234", "bf16": {"w1": {"output_tok_s": 1100.0}, "batch1": {"output_tok_s": 100.0}},
            "w2": {"w2": {"seconds": 40.0}, "ttft_8192_ms": 100.0, "batch1_8k": {"output_tok_s": 180.0}},
            "fp8": {"error": "RuntimeError: boom"},
            "w2-short-tiles": {"w2": {"seconds": 50.0}, "ttft_8192_ms": 120.0, "batch1_8k": {"output_tok_s": 180.0},
                               "knobs": {"x.Y": 1}}}
    (tmp_path / "b" / "kvserve.json").write_text(json.dumps(ours))
    gpu_compare.print_table([str(tmp_path / "a"), str(tmp_path / "b")])
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert "kvserve abc1234" in out and "vLLM 0.26.0" in out and "kvserve fp8 FAILED: RuntimeError: boom" in out
    assert rows["W1 bf16, output tok/s"].endswith("| 1.10x |")  # higher is better: kvserve / vLLM
    assert rows["batch-1 bf16, tok/s"].endswith("| 0.50x |")
    assert rows["W2 long context, seconds for the whole run"].endswith("| 0.75x |")  # lower is better: vLLM / kvserve
    assert rows["TTFT of an 8,192-token prompt, ms"].endswith("| 2.00x |")
    assert rows["batch-1 decode at 8,192 tokens of context, tok/s"].endswith("| 1.00x |")
    assert "| not run | not run |" in rows["W1 AWQ int4, output tok/s"]
    ab = [line for line in out.splitlines() if "vs w2-short-tiles" in line]  # the A/B rows: this tree vs off
    assert any(line.startswith("| w2 w2 seconds") and line.endswith("| 1.25x |") for line in ab), ab
    assert any(line.startswith("| w2 ttft_8192_ms") and line.endswith("| 1.20x |") for line in ab), ab


def test_ab_knobs_set_and_restore_module_and_class_attributes():
    from kvserve.model.quantization import fp8
    from kvserve.ops.triton_attention import TritonAttentionBackend

    def read():
        return fp8.FUSE_ACTIVATION_QUANT, TritonAttentionBackend.LONG_PREFILL_MIN_QUERY

    original = read()
    fuse, long_min = gpu_compare.AB_CONFIGS["fp8-unfused"][1], gpu_compare.AB_CONFIGS["w2-short-tiles"][1]
    restore = gpu_compare.set_attributes({**fuse, **long_min})
    assert read() == (*fuse.values(), *long_min.values()) != original
    gpu_compare.set_attributes(restore)
    assert read() == original


def test_online_part_keeps_both_servers_results_and_the_table_shows_them(tmp_path, capsys, monkeypatch):
    # A stand-in for the bundle's serve_bench.sh: it writes what `vllm bench serve --save-result` writes.
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "serve_bench.sh").write_text(
        'echo \'{"output_throughput": 9000.0, "p99_ttft_ms": 3400.0, "completed": 512}\' > "$OUT/vllm_serve.json"\n'
        'echo \'{"output_throughput": 9900.0, "p99_ttft_ms": 3740.0, "completed": 512}\' > "$OUT/kvserve_serve.json"\n')
    monkeypatch.delenv("OUT", raising=False)
    args = type("Args", (), {"bundle": str(bundle), "results": str(tmp_path / "r"), "commit": "abc1234"})()
    gpu_compare.run_online(args)
    saved = json.loads((tmp_path / "r" / "online_serve.json").read_text())
    assert saved["vllm"]["output_throughput"] == 9000.0 and saved["kvserve"]["p99_ttft_ms"] == 3740.0
    gpu_compare.print_table([str(tmp_path / "r")])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ")}
    assert rows["online, 256 streams (`vllm bench serve`), output tok/s"].endswith("| 1.10x |")
    assert rows["online, 256 streams, p99 TTFT ms"].endswith("| 0.91x |")  # lower is better: vLLM / kvserve


def test_online_part_reports_a_server_that_wrote_nothing(tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "serve_bench.sh").write_text('echo \'{"output_throughput": 9000.0}\' > "$OUT/vllm_serve.json"\n')
    monkeypatch.delenv("OUT", raising=False)
    args = type("Args", (), {"bundle": str(bundle), "results": str(tmp_path / "r"), "commit": "abc1234"})()
    gpu_compare.run_online(args)
    saved = json.loads((tmp_path / "r" / "online_serve.json").read_text())
    assert "error" in saved["kvserve"] and saved["vllm"]["output_throughput"] == 9000.0
