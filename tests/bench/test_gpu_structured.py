"""benchmarks/gpu_structured.py without a GPU: its dry run builds the tiny model, runs kvserve with and
without the schema on the same output lengths, validates every constrained output, starts vLLM's part in
its subprocess (which reports itself not run where vllm cannot be imported) and prints the table; the
table reads a vLLM result with the ratios the right way round."""

from __future__ import annotations

import json

from benchmarks import gpu_structured


def test_dry_run_exercises_every_part_but_the_gpu(tmp_path, capsys):
    result = gpu_structured.main(["--dry-run", "--out", str(tmp_path)])
    ours = result["kvserve"]
    constrained, free = ours["constrained"], ours["unconstrained"]
    assert constrained["num_requests"] == gpu_structured.DRY_RUN_PROMPTS
    assert constrained["valid"] == constrained["finished_stop"] == constrained["num_requests"]
    assert free["output_tokens"] == constrained["output_tokens"] > 0  # the same lengths, without the schema
    assert constrained["mask_steps"] > 0 and constrained["mask_ms_mean"] > 0
    assert "not_run" in result["vllm"] and result["ratio_vs_vllm"] is None
    assert json.loads((tmp_path / "gpu_structured.json").read_text())["num_prompts"] == gpu_structured.DRY_RUN_PROMPTS
    out = capsys.readouterr().out
    assert "kvserve, JSON schema" in out and "vLLM: not run" in out


def test_table_with_vllm(capsys):
    run = {"seconds": 2.0, "output_tokens": 2000, "tokens_per_s": 1000.0, "finished_stop": 4, "valid": 4,
           "num_requests": 4, "problems": [], "mask_ms_mean": 0.5, "mask_ms_p99": 0.9}
    result = {"device": "GPU", "device_type": "cuda", "num_prompts": 4, "tokenizer": "t", "apply_ms_256_rows": 0.1,
              "kvserve": {"vocab_size": 128256, "constrained": run,
                          "unconstrained": {**run, "tokens_per_s": 1040.0}},
              "vllm": {**run, "vllm_version": "0.26.0", "tokens_per_s": 1100.0, "valid": 3,
                       "problems": ["ValidationError: x"]},
              "ratio_vs_unconstrained": 1000 / 1040, "ratio_vs_vllm": 1000 / 1100}
    gpu_structured.print_table(result)
    out = capsys.readouterr().out
    assert "vLLM 0.26.0, JSON schema" in out and "3/4" in out
    assert "0.962x (met)" in out and "0.909x (MISSED)" in out
    assert "vLLM: outputs that do not validate, e.g. ValidationError: x" in out
