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
    assert "both engines" in result["weights"] and constrained["lengths"]["max"] >= constrained["lengths"]["min"] > 0
    assert f"{constrained['lengths']['mean']:.0f} (" in out  # each run's output lengths are printed


def test_random_checkpoint_is_sharded_reproducible_and_loads(tmp_path):
    """The weights both engines load: HF safetensors shards with their index, the same for the same seed,
    written once (a second call finds them)."""
    import torch
    import transformers
    from safetensors.torch import load_file

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                      architectures=["LlamaForCausalLM"])
    paths = [tmp_path / "a", tmp_path / "b"]
    for path in paths:
        config.save_pretrained(path)
        assert gpu_structured.write_random_checkpoint(str(path), "cpu", shard_bytes=20_000) >= 0
    shards = sorted(p.name for p in paths[0].glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((paths[0] / "model.safetensors.index.json").read_text())["weight_map"]
    model = transformers.AutoModelForCausalLM.from_pretrained(paths[0], torch_dtype=torch.bfloat16)
    state = model.state_dict()
    assert set(index) == set(state)
    for name in shards:
        a, b = load_file(paths[0] / name), load_file(paths[1] / name)
        for key, tensor in a.items():
            assert torch.equal(tensor, b[key]) and torch.equal(tensor, state[key])
    assert gpu_structured.write_random_checkpoint(str(paths[0]), "cpu") == 0.0  # found, not rewritten


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
