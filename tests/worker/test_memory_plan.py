"""`kvserve plan` against the engine's own start-up numbers, and against arithmetic done by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvserve import LLM
from kvserve.config import EngineArgs
from kvserve.entrypoints.cli import main as cli_main
from kvserve.model.model_config import ModelConfig
from kvserve.sizing import memory_plan
from kvserve.sizing.memory_plan import GiB

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
H100 = 79.2  # GiB, the known-GPU table's H100-80GB
OTHERS = 0.5  # GiB, the plan's default for the CUDA context


def run_plan(capsys, *argv) -> dict:
    assert cli_main(["plan", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _flag_supported(**kwargs) -> bool:
    try:
        EngineArgs(**kwargs)
        return True
    except ValueError:
        return False


# ---- plan == engine ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,dtype,kv_dtype", [
    ("llama", "float32", "auto"), ("qwen2", "bfloat16", "auto"), ("qwen3", "float32", "fp8"),
    ("gemma2", "float32", "auto"), ("gemma3", "bfloat16", "auto"),
])
def test_plan_equals_engine_allocation(tiny_model_factory, capsys, arch, dtype, kv_dtype):
    if kv_dtype != "auto" and not _flag_supported(kv_cache_dtype=kv_dtype):
        pytest.skip("--kv-cache-dtype fp8 is not in this engine yet")
    path, _ = tiny_model_factory(arch)
    kv_bytes = 3 * 1024 * 1024 + 12345  # not a whole number of blocks
    flags = dict(max_model_len=256, kv_cache_memory_bytes=kv_bytes, dtype=dtype, max_num_seqs=8)
    if kv_dtype != "auto":
        flags["kv_cache_dtype"] = kv_dtype
    engine = LLM(path, device="cpu", **flags).llm_engine
    argv = [path]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", v]
    plan = run_plan(capsys, *argv, "--gpu", "H100")

    num_blocks = engine.kv_cache_manager.num_blocks
    allocated = sum(t.numel() * t.element_size() for t in engine.runner.kv_tensors)
    assert plan["num_blocks"] == num_blocks
    assert plan["kv_bytes_per_block"] * num_blocks == allocated  # what the runner really allocated
    if arch.startswith("gemma"):
        # 3 layers (windowed, full, windowed of 24): 3 KV cache groups of one layer, so a block holds one
        # layer; a decoding request of 256 tokens holds 16 blocks in the full group and
        # cdiv(24, 16) + 1 = 3 in each windowed one.
        assert [g["window"] for g in plan["kv_cache_groups"]] == [24, None, 24]
        assert plan["kv_bytes_per_block"] == 2 * 2 * 16 * 16 * memory_plan.DTYPE_BYTES[dtype]
        assert plan["max_concurrency"] == pytest.approx(num_blocks / (16 + 2 * 3))
        assert 0 < plan["kv_tokens"] < num_blocks * 16
    else:
        assert plan["kv_tokens"] == num_blocks * 16
        assert plan["max_concurrency"] == pytest.approx(num_blocks * 16 / 256)
    # Weights: the checkpoint's headers give exactly the bytes the loaded model holds (incl. rotary tables).
    held = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    # (k_scale / v_scale are 4-byte scalars of the KV cache, per layer: not weights.)
    held += sum(b.numel() * b.element_size() for name, b in engine.runner.model.named_buffers()
                if not name.endswith(("k_scale", "v_scale")))
    assert plan["weights_source"] == "checkpoint"
    assert plan["ranks"][0]["weights"] == held


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_arithmetic_equals_model_parameters(tiny_model_factory, arch):
    """The shape arithmetic (used for dummy weights, tp/pp and quantization) counts every parameter."""
    path, hf = tiny_model_factory(arch)
    cfg = ModelConfig.from_path(path)
    shape = memory_plan.rank_shapes(cfg)[0]
    hf_params = {n: p for n, p in hf.named_parameters()}
    count = sum(p.numel() for n, p in hf_params.items() if not (cfg.tie_word_embeddings and n == "lm_head.weight"))
    assert memory_plan.weight_bytes(shape, 4) == count * 4


def test_plan_with_tp2_equals_engine(tiny_model_factory, capsys):
    if not _flag_supported(tensor_parallel_size=2):
        pytest.skip("tensor parallelism is not in this engine yet")
    path, _ = tiny_model_factory("llama")
    llm = LLM(path, device="cpu", max_model_len=256, kv_cache_memory_bytes=2 << 20, tensor_parallel_size=2)
    num_blocks = llm.llm_engine.kv_cache_manager.num_blocks
    llm.llm_engine.shutdown()
    # --kv-cache-memory-bytes is per GPU; each rank holds half the KV heads, so twice the blocks of tp=1.
    plan = run_plan(capsys, path, "--max-model-len", 256, "--kv-cache-memory-bytes", 2 << 20, "-tp", 2,
                    "--dtype", "float32")
    assert plan["num_blocks"] == num_blocks
    assert plan["kv_bytes_per_block"] * num_blocks <= 2 << 20 < plan["kv_bytes_per_block"] * (num_blocks + 1)


def test_kv_cache_bytes_per_token_per_rank():
    cfg = ModelConfig.from_path(EXAMPLES / "llama-3.1-8b")
    assert memory_plan.kv_bytes_per_token(memory_plan.rank_shapes(cfg)[0], 2) == 32 * 2 * 8 * 128 * 2
    # 8 KV heads over 16 ranks: each rank keeps one (replicated), not half of one.
    with pytest.raises(ValueError, match="tensor-parallel-size 3"):
        memory_plan.rank_shapes(cfg, tp=3)
    assert memory_plan.rank_shapes(cfg, tp=16)[0].num_kv_heads == 1
    assert memory_plan.pipeline_layers(126, 4) == [32, 32, 31, 31]
    assert memory_plan.kv_cache_dtype_bytes("fp8", "bfloat16") == 1
    assert memory_plan.kv_cache_dtype_bytes("auto", "float32") == 4


# ---- verdicts a person computes by hand ---------------------------------------------------------------
def _params_per_layer(h, q, kv, inter):
    return h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h  # qkv, o, gate/up/down, two norms


ROTARY = 2 * 131072 * 64 * 4  # cos + sin, fp32, max_model_len x head_dim / 2


def test_70b_on_h100_needs_four_gpus(capsys):
    model = EXAMPLES / "llama-3.1-70b"
    # Llama-3.1-70B: 80 layers of (hidden 8192, 64 x 128 query, 8 x 128 KV, MLP 28672), vocab 128256 untied.
    params = 80 * _params_per_layer(8192, 8192, 1024, 28672) + 2 * 128256 * 8192 + 8192
    assert params == 70_553_706_496
    plan = run_plan(capsys, model, "--gpu", "H100")
    assert plan["ranks"][0]["weights"] == params * 2 + ROTARY  # 131.48 GiB in bf16
    available = (H100 * 0.9 - OTHERS) * GiB  # 70.78 GiB: not enough for 131.48 GiB
    assert params * 2 > available
    # tp 2: 65.7 GiB of weights per GPU leaves < 5.1 GiB; a 131072-token request needs
    # 131072 x (80 layers x 2 x 4 KV heads x 128 x 2 B = 163,840 B) = 20 GiB: no.
    # tp 4: 32.9 GiB of weights, 37.9 GiB left; the request needs 131072 x 81,920 B = 10 GiB: yes.
    assert (params * 2 / 2) > available - 131072 * 163_840
    assert (params * 2 / 4) + 131072 * 81_920 + 6 * GiB < available
    assert plan["verdict"]["flag"] == "--tensor-parallel-size" and plan["verdict"]["value"] == 4

    # At tp 2 the weights fit and the length does not: the largest max_model_len that fits.
    plan = run_plan(capsys, model, "--gpu", "H100", "-tp", 2)
    assert plan["ranks"][0]["kv_bytes_per_token"] == 163_840
    longest = plan["verdict"]["value"]
    assert plan["verdict"]["flag"] == "--max-model-len" and longest == plan["kv_tokens"]
    assert 0 < longest <= (available - params) / 163_840 < 131072
    # ... and that value is a plan that fits.
    plan = run_plan(capsys, model, "--gpu", "H100", "-tp", 2, "--max-model-len", longest)
    assert plan["verdict"]["step"] == "fits"


def test_405b_on_80gb_gpus(capsys):
    model = EXAMPLES / "llama-3.1-405b"
    # One of 8 tensor-parallel ranks of a layer: 128/8 query heads, 1 KV head (8 over 8), MLP 53248/8.
    per_rank_layer = _params_per_layer(16384, 16 * 128, 128, 6656)
    vocab_rows = 128256 // 8 * 16384  # embedding (or lm_head) slice
    # tp 8 x pp 2: 63 layers per stage, stage 0 holds the embedding, stage 1 the head and final norm.
    stage0 = 63 * per_rank_layer + vocab_rows
    plan = run_plan(capsys, model, "--gpu", "H100", "-tp", 8, "-pp", 2)
    assert plan["ranks"][0]["weights"] == stage0 * 2 + ROTARY  # 47.31 GiB
    per_token = 63 * 2 * 1 * 128 * 2
    assert plan["ranks"][0]["kv_bytes_per_token"] == per_token == 32_256
    # KV: 70.78 - 47.31 GiB minus the step's activations (a few GiB at most) over 32,256 B per token.
    upper = ((H100 * 0.9 - OTHERS) * GiB - stage0 * 2) / per_token
    assert upper - 3 * GiB / per_token < plan["kv_tokens"] <= upper
    assert plan["kv_tokens"] > 131072 and plan["verdict"]["step"] == "fits"

    # tp 8 alone: 126 layers + embedding + head = 94.5 GiB per GPU: no. tp is at 8 already, so FP8 weights:
    # 1 byte per linear weight, embeddings and norms stay bf16 = 47.8 GiB, and KV of 64,512 B per token fits.
    bf16 = (126 * per_rank_layer + 2 * vocab_rows) * 2
    fp8 = 126 * (per_rank_layer - 2 * 16384) + 126 * 2 * 16384 * 2 + 2 * vocab_rows * 2
    assert bf16 > (H100 * 0.9 - OTHERS) * GiB > fp8 + 131072 * 64_512
    plan = run_plan(capsys, model, "--gpu", "H100", "-tp", 8)
    assert plan["verdict"]["flag"] == "--quantization" and plan["verdict"]["value"] == "fp8"
    plan = run_plan(capsys, model, "--gpu", "H100", "-tp", 8, "--quantization", "fp8")
    # + the final norm (bf16) and one fp32 scale per linear layer (4 per decoder layer)
    assert plan["ranks"][0]["weights"] == fp8 + 16384 * 2 + 126 * 4 * 4 + ROTARY
    assert plan["verdict"]["step"] == "fits"


def test_plan_text_output_and_errors(capsys, tmp_path):
    assert cli_main(["plan", str(EXAMPLES / "llama-3.1-8b"), "--gpu", "H200", "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    for line in ("weights", "activation peak", "CUDA graph reserve", "KV bytes per token", "KV tokens",
                 "max concurrency", "Verdict: It fits"):
        assert line in out
    assert cli_main(["plan", str(EXAMPLES / "llama-3.1-8b"), "--gpu", "Z80"]) == 2
    assert "not a known GPU" in capsys.readouterr().err
    shutil.copy(EXAMPLES / "llama-3.1-8b" / "config.json", tmp_path / "config.json")
    assert cli_main(["plan", str(tmp_path), "-tp", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_readme_plan_commands_run_and_print_what_the_readme_shows(capsys, monkeypatch):
    import re
    import shlex

    readme = (EXAMPLES.parent.parent / "README.md").read_text()
    section = readme[readme.index("## When memory is short"):]
    commands = re.search(r"```bash\n(kvserve plan .*?)```", section, flags=re.DOTALL).group(1).strip().splitlines()
    shown = re.search(r"```text\n(.*?)```", section, flags=re.DOTALL).group(1)
    monkeypatch.chdir(EXAMPLES.parent.parent)
    outputs = []
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "kvserve" and cli_main(argv[1:]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == shown
    assert json.loads(outputs[2])["verdict"]["step"] == "fits"


def test_plan_counts_a_quantized_checkpoint_as_stored(tmp_path, capsys):
    """An fp8 checkpoint (experts included) is planned in fp8 without --quantization: at tp 1 from its tensors'
    bytes, split over ranks as FP8 weights; `--quantization fp8` on the bf16 twin plans the same bytes per rank."""
    from benchmarks.write_random_checkpoint import write
    from kvserve.model.quantization.fp8 import Fp8Config
    from tests.bench.test_write_random_checkpoint import TINY_QWEN3_MOE

    fp8_dir, bf16_dir = write(TINY_QWEN3_MOE, str(tmp_path / "fp8"), True, "cpu"), \
        write(TINY_QWEN3_MOE, str(tmp_path / "bf16"), False, "cpu")
    common = ("--max-model-len", 256, "--gpu", "H100")
    single = run_plan(capsys, fp8_dir, *common)
    assert single["weights_source"] == "checkpoint"
    stored = sum(f.stat().st_size for f in (tmp_path / "fp8").glob("*.safetensors"))
    assert abs(single["ranks"][0]["weights"] - stored) < 0.01 * stored  # plus the rotary table, less file headers
    split = run_plan(capsys, fp8_dir, *common, "-tp", 2)
    what_if = run_plan(capsys, bf16_dir, *common, "-tp", 2, "--quantization", "fp8")
    unquantized = run_plan(capsys, bf16_dir, *common, "-tp", 2)
    assert split["ranks"][0]["weights"] == what_if["ranks"][0]["weights"] < unquantized["ranks"][0]["weights"]
    assert memory_plan.weights_format(Fp8Config(checkpoint_is_fp8=True)) == dict(quantization="fp8",
                                                                                  quantized_at_load=False)
    assert memory_plan.weights_format(Fp8Config(checkpoint_is_fp8=False)) == dict(quantization="fp8",
                                                                                   quantized_at_load=True)
    assert memory_plan.weights_format(None) == dict(quantization=None, quantized_at_load=False)
