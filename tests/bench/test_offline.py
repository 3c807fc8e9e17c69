"""`kvserve bench throughput` and `kvserve bench latency` on CPU, CI-sized: the printed lines and JSON
fields are vLLM's, and the token counts add up to what the engine generated."""

from __future__ import annotations

import json
import re

import pytest

from kvserve.entrypoints.cli import main

_THROUGHPUT = re.compile(r"^Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s$",
                         re.MULTILINE)


def _run(capsys, *args) -> str:
    assert main(["bench", *args, "--disable-tqdm"]) == 0
    return capsys.readouterr().out


def _check_throughput(out: str, result: dict, n: int, in_len: int, out_len: int) -> None:
    req_s, tok_s, out_s = map(float, _THROUGHPUT.search(out).groups())
    assert f"Total num prompt tokens:  {n * in_len}" in out
    assert f"Total num output tokens:  {n * out_len}" in out
    assert "WARNING" not in out
    assert result["num_requests"] == n
    assert result["num_prompt_tokens"] == n * in_len
    assert result["num_output_tokens"] == result["expected_output_tokens"] == n * out_len
    assert result["total_num_tokens"] == n * (in_len + out_len)
    elapsed = result["elapsed_time"]
    assert result["requests_per_second"] == pytest.approx(n / elapsed)
    assert result["output_tokens_per_second"] == pytest.approx(n * out_len / elapsed)
    assert (req_s, tok_s, out_s) == pytest.approx(
        (result["requests_per_second"], result["tokens_per_second"], result["output_tokens_per_second"]), abs=0.006)
    assert result["machine"] and "Machine: " + result["machine"] in out


def test_throughput_tiny_llama_with_hf_baseline(capsys, tmp_path, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    out = _run(capsys, "throughput", "--model", path, "--num-prompts", "6", "--input-len", "24", "--output-len", "8",
               "--baseline", "hf", "--hf-batch-size", "4", "--max-model-len", "128",
               "--output-json", str(tmp_path / "t.json"))
    result = json.loads((tmp_path / "t.json").read_text())
    _check_throughput(out, result, 6, 24, 8)
    base = result["baseline"]
    assert base["num_output_tokens"] == 6 * 8 and base["batch_size"] == 4
    assert result["ratio_vs_baseline"] == pytest.approx(result["output_tokens_per_second"]
                                                        / base["output_tokens_per_second"])
    assert re.search(r"^HF transformers generate \(static batches of 4\): Throughput: ", out, re.MULTILINE)
    ratio_line = re.search(r"^Ratio kvserve / HF: ([\d.]+)x output tokens/s \(identical greedy outputs: (\d+)/6\)$",
                           out, re.MULTILINE)
    assert float(ratio_line.group(1)) == pytest.approx(result["ratio_vs_baseline"], abs=0.006)
    assert base["identical_greedy_outputs"] >= 5  # fp32, same weights: left padding may flip a near-tie


def test_throughput_prefix_dataset_counts(capsys, tmp_path, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    out = _run(capsys, "throughput", "--model", path, "--dataset", "prefix", "--num-prompts", "6", "--prefix-len",
               "32", "--num-prefixes", "2", "--input-len", "8", "--output-len", "4", "--max-model-len", "128",
               "--output-json", str(tmp_path / "t.json"))
    _check_throughput(out, json.loads((tmp_path / "t.json").read_text()), 6, 40, 4)


def test_throughput_w1_needs_its_model(capsys, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    assert main(["bench", "throughput", "--model", path, "--dataset", "w1", "--num-prompts", "2"]) == 2
    assert "w1-llama-8b-dummy" in capsys.readouterr().err


def test_latency_tiny_llama(capsys, tmp_path, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    out = _run(capsys, "latency", "--model", path, "--batch-size", "3", "--input-len", "16", "--output-len", "4",
               "--num-iters-warmup", "1", "--num-iters", "5", "--output-json", str(tmp_path / "l.json"))
    result = json.loads((tmp_path / "l.json").read_text())
    assert len(result["latencies"]) == 5 and result["output_tokens_per_iter"] == 12
    avg = float(re.search(r"^Avg latency: ([\d.e-]+) seconds$", out, re.MULTILINE).group(1))
    assert avg == pytest.approx(result["avg_latency"]) == pytest.approx(sum(result["latencies"]) / 5)
    printed = [float(v) for v in re.findall(r"^\d+% percentile latency: ([\d.e-]+) seconds$", out, re.MULTILINE)]
    assert re.findall(r"^(\d+)% percentile", out, re.MULTILINE) == ["10", "25", "50", "75", "90", "99"]
    assert printed == pytest.approx(list(result["percentiles"].values()))
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])


@pytest.mark.slow
def test_throughput_and_latency_smollm2(capsys, tmp_path):
    """The embedded default model, as a user runs it: no --model."""
    out = _run(capsys, "throughput", "--num-prompts", "3", "--input-len", "16", "--output-len", "4",
               "--max-model-len", "256", "--output-json", str(tmp_path / "t.json"))
    result = json.loads((tmp_path / "t.json").read_text())
    _check_throughput(out, result, 3, 16, 4)
    assert result["model"] == "SmolLM2-135M-Instruct"
    out = _run(capsys, "latency", "--batch-size", "2", "--input-len", "8", "--output-len", "3",
               "--num-iters-warmup", "0", "--num-iters", "2", "--max-model-len", "256")
    assert re.search(r"^Avg latency: [\d.e-]+ seconds$", out, re.MULTILINE)
    assert "99% percentile latency:" in out


def test_throughput_sharegpt_file(capsys, tmp_path, tiny_model_factory, smol_tokenizer):
    path, _ = tiny_model_factory("llama")
    conversations = [
        {"conversations": [{"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
                           {"from": "gpt", "value": f"The answer is {2 * i}, since {i} + {i} = {2 * i}."}]}
        for i in range(5)
    ]
    (tmp_path / "sg.json").write_text(json.dumps(conversations))
    out = _run(capsys, "throughput", "--model", path, "--dataset", "sharegpt", "--dataset-path",
               str(tmp_path / "sg.json"), "--num-prompts", "4", "--max-model-len", "128",
               "--output-json", str(tmp_path / "t.json"))
    result = json.loads((tmp_path / "t.json").read_text())
    # Which four of five depends on the seeded shuffle; the reply lengths set the output lengths.
    lens = {len(smol_tokenizer(c["conversations"][1]["value"]).input_ids) for c in conversations}
    assert result["num_requests"] == 4
    assert result["num_output_tokens"] == result["expected_output_tokens"]
    assert 4 * min(lens) <= result["num_output_tokens"] <= 4 * max(lens)
    assert f"Total num output tokens:  {result['num_output_tokens']}" in out


def test_w1_model_alias_resolves_without_weights():
    import argparse

    from kvserve.bench.engine_setup import add_model_args, bench_engine_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    for argv, dataset in ([], "w1"), (["--model", "w1-llama-8b-dummy"], "random"):
        with bench_engine_args(p.parse_args(argv), dataset) as args:
            assert (args.load_format, args.skip_tokenizer_init, args.max_model_len) == ("dummy", True, 4096)
            config = args.create_engine_config()  # only config.json is there: no weights are needed for this
            assert config.model_config.vocab_size == 128256 and config.served_model_name == "w1-llama-8b-dummy"
    with bench_engine_args(p.parse_args(["--max-model-len", "2048"]), "w1") as args:
        assert args.max_model_len == 2048
    with bench_engine_args(p.parse_args([]), "random") as args:
        assert args.model is None and args.load_format == "auto"  # the embedded default model
