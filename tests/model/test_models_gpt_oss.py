"""gpt-oss: greedy tokens identical to HF transformers (fp32, CPU) on a tiny random GptOssForCausalLM built with
HF's own classes: 8 experts, top-2, biased router and experts with a swiglu_limit small enough to clamp,
attention sinks, windowed layers (tests/conftest.py: WINDOW) shorter than the prompts alternating with full
ones, YaRN rope. With chunked prefill, prefix hits and preemption; TP=2 and expert parallel equal to TP=1;
and MXFP4 experts (quantized here, as the released checkpoints store them) equal to HF on the dequantized
weights."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.model_config import ModelConfig
from tests.conftest import TINY_VOCAB, WINDOW, hf_greedy, random_prompts

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _hf_config():
    import transformers

    return transformers.GptOssConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
        swiglu_limit=0.6, max_position_embeddings=256, eos_token_id=2, bos_token_id=1, initializer_range=0.1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0})


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, smol_tokenizer):
    import transformers

    torch.manual_seed(31)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config()).eval()
    with torch.no_grad():  # HF initialises the expert biases to zero and the sinks small: make them count
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.2)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.2)
            layer.self_attn.sinks.normal_(0, 1.5)
    path = tmp_path_factory.mktemp("tiny-gpt-oss")
    model.save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return str(path), model


def _shared_prefix_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 40000) for _ in range(rng.randint(50, 90))] for _ in range(2)]
    return [prefixes[i % 2] + [rng.randrange(3, 40000) for _ in range(rng.randint(1, 30))] for i in range(6)]


PROMPTS = random_prompts(5, WINDOW + 1, 4 * WINDOW, seed=9) + _shared_prefix_prompts(3)


@pytest.fixture(scope="module")
def expected(gpt_oss):
    tokens = hf_greedy(gpt_oss[1], PROMPTS, MAX_TOKENS)
    assert len({tuple(t) for t in tokens}) > 1  # the oracle is not degenerate
    return tokens


def _generate(path, prompts=PROMPTS, **kwargs):
    llm = LLM(path, **{"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20, **kwargs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()


def test_config_reads_the_gpt_oss_fields(gpt_oss):
    cfg = ModelConfig.from_path(gpt_oss[0])
    assert cfg.layer_windows == [WINDOW, None, WINDOW] and cfg.kv_cache_group_windows == [WINDOW, None, WINDOW]
    assert cfg.attention_sinks and cfg.o_proj_bias and cfg.attention_bias
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.num_moe_layers) == (8, 2, 32, 3)
    assert (cfg.moe_router, cfg.moe_activation, cfg.moe_bias, cfg.swiglu_limit) == ("topk_softmax", "swiglu_oai",
                                                                                    True, 0.6)
    assert cfg.rope_scaling["rope_type"] == "yarn"


def test_num_params_counts_what_hf_holds(gpt_oss):
    path, hf_model = gpt_oss
    cfg = ModelConfig.from_path(path)
    assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters())
    idle = cfg.num_moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * (3 * 64 * 32 + 2 * 32 + 64)
    assert cfg.num_active_params() == cfg.num_params() - idle


def test_matches_hf_over_prompts_longer_than_the_window(gpt_oss, expected):
    assert min(len(p) for p in PROMPTS) > WINDOW
    tokens, _ = _generate(gpt_oss[0], enable_prefix_caching=False)
    assert tokens == expected


def test_matches_hf_with_chunks_prefix_hits_and_preemption(gpt_oss, expected):
    tokens, stats = _generate(gpt_oss[0], max_num_batched_tokens=20, max_num_seqs=6, num_gpu_blocks_override=18,
                              max_model_len=160)
    assert tokens == expected
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(tensor_parallel_size=2, enable_expert_parallel=True)], ids=["tp2", "ep2"])
def test_tensor_and_expert_parallel_match_tp1(gpt_oss, expected, parallel):
    """TP=2 splits the heads (and their sinks), the experts' features (the down bias added on one rank) or,
    with expert parallelism, places whole experts (with their biases) per rank."""
    prompts = PROMPTS[:3]
    tokens, _ = _generate(gpt_oss[0], prompts, max_num_batched_tokens=32, max_num_seqs=4, **parallel)
    assert tokens == expected[:3]


def _quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (blocks uint8 [E, N, K / 32, 16], scales uint8 [E, N, K / 32]): per group of 32, the
    exponent that brings the largest |value| to at most 6 (E2M1's largest), each value rounded to the nearest
    E2M1 value; the layout the released checkpoints use, written independently of kvserve's reader."""
    from kvserve.ops.mxfp4 import FP4_VALUES

    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent)
    grid = torch.tensor(FP4_VALUES[:8])
    index = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1) + 8 * (scaled < 0)
    pairs = index.reshape(*index.shape[:-1], 16, 2).to(torch.uint8)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def _mxfp4_state(state: dict) -> tuple[dict, dict]:
    """(the state with its experts as MXFP4 _blocks/_scales, the state with those experts as transformers' own
    MXFP4 code dequantizes them from the same blocks)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    quantized, dequantized = dict(state), dict(state)
    for name in list(state):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _quantize_mxfp4(state[name].transpose(1, 2))  # HF's [E, in, out] -> [E, out, in]
            del quantized[name]
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert not torch.equal(dequantized[name], state[name])  # the round trip is lossy: a real test
    return quantized, dequantized


MXFP4_QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


@pytest.fixture(scope="module")
def mxfp4_checkpoint(gpt_oss, tmp_path_factory):
    """(a checkpoint as the released gpt-oss ones are stored: experts as _blocks/_scales, quantization_config
    mxfp4; HF's greedy tokens on a float checkpoint of the weights transformers dequantizes from them)."""
    import transformers
    from safetensors.torch import load_file, save_file

    path, _ = gpt_oss
    quantized, dequantized = _mxfp4_state(load_file(f"{path}/model.safetensors"))
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    mx_dir, float_dir = root / "mxfp4", root / "dequantized"
    for d, weights in ((mx_dir, quantized), (float_dir, dequantized)):
        shutil.copytree(path, d)
        save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((mx_dir / "config.json").read_text())
    config["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
    (mx_dir / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    return str(mx_dir), hf_greedy(hf, PROMPTS[:4], MAX_TOKENS)


def test_mxfp4_experts_match_hf_on_the_dequantized_weights(mxfp4_checkpoint):
    """On the CPU path the experts are loaded packed and dequantized once, after loading."""
    path, expected_tokens = mxfp4_checkpoint
    tokens, _ = _generate(path, PROMPTS[:4])
    assert tokens == expected_tokens


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(tensor_parallel_size=2, enable_expert_parallel=True)], ids=["tp2", "ep2"])
def test_mxfp4_tensor_and_expert_parallel_match_hf(mxfp4_checkpoint, parallel):
    """TP=2 leaves each rank 16 of the 32 intermediate features, half a group: those ranks dequantize at load;
    expert parallelism keeps whole experts, packed."""
    path, expected_tokens = mxfp4_checkpoint
    tokens, _ = _generate(path, PROMPTS[:3], max_num_batched_tokens=32, max_num_seqs=4, **parallel)
    assert tokens == expected_tokens[:3]


MXFP4_TRITON_SCRIPT = r"""
import json, sys
from kvserve import LLM, SamplingParams
path, prompts, max_tokens = json.loads(sys.stdin.read())
llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=24, max_num_seqs=4)
experts = llm.llm_engine.executor.worker.runner.model.layers[0].mlp.experts
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "packed": experts.mxfp4_packed,
                  "dtype": str(experts.w13_weight.dtype)}))
"""


def test_mxfp4_experts_packed_through_the_triton_kernel_match_hf(mxfp4_checkpoint):
    """The GPU code path under Triton's interpreter (a subprocess, TRITON_INTERPRET=1): the experts stay MXFP4
    bytes and the fused-MoE kernel decodes them; the same tokens as HF, with chunked prefill."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.triton_interpreter import interpreter_unusable

    pytest.importorskip("triton")
    if interpreter_unusable():
        pytest.skip(interpreter_unusable())
    path, expected_tokens = mxfp4_checkpoint
    proc = subprocess.run([sys.executable, "-c", MXFP4_TRITON_SCRIPT], input=json.dumps([path, PROMPTS[:2], MAX_TOKENS]),
                          capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"},
                          cwd=Path(__file__).resolve().parents[2], timeout=1500, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["packed"] and result["dtype"] == "torch.uint8"
    assert result["tokens"] == expected_tokens[:2]


def test_mxfp4_packed_experts_load_each_ranks_share(monkeypatch, tmp_path):
    """Rank 1 of TP=2 with 64 intermediate features (two whole groups a rank): its packed gate, up and down
    bytes and scales dequantize to its slice of the full experts."""
    import transformers

    from kvserve.distributed import parallel_state
    from kvserve.model.quantization.mxfp4 import Mxfp4Config
    from kvserve.model.registry import model_class
    from kvserve.ops.mxfp4 import dequantize_mxfp4

    torch.manual_seed(3)
    hf_config = _hf_config()
    hf_config.intermediate_size, hf_config.num_hidden_layers = 64, 1
    hf_config.layer_types = hf_config.layer_types[:1]
    hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_QUANTIZATION_CONFIG}))
    quantized, dequantized = _mxfp4_state(hf.state_dict())
    cfg = ModelConfig.from_path(tmp_path)
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.ParallelState(rank=1, world_size=2, tp_size=2))
    model = model_class(cfg.architecture)(cfg, None, 64, quant_config=Mxfp4Config())
    model.load_weights(quantized.items())
    experts = model.layers[0].mlp.experts
    assert experts.mxfp4_packed and experts.w13_weight.dtype == torch.uint8
    full_gate_up = dequantized["model.layers.0.mlp.experts.gate_up_proj"].transpose(1, 2)  # [E, 2I, H] interleaved
    full_down = dequantized["model.layers.0.mlp.experts.down_proj"].transpose(1, 2)  # [E, H, I]
    w13 = dequantize_mxfp4(experts.w13_weight.data, experts.w13_weight_scale.data, torch.float32)
    w2 = dequantize_mxfp4(experts.w2_weight.data, experts.w2_weight_scale.data, torch.float32)
    mine = slice(32, 64)
    torch.testing.assert_close(w13[:, :32], full_gate_up[:, 0::2][:, mine], atol=0, rtol=0)
    torch.testing.assert_close(w13[:, 32:], full_gate_up[:, 1::2][:, mine], atol=0, rtol=0)
    torch.testing.assert_close(w2, full_down[:, :, mine], atol=0, rtol=0)


def test_mxfp4_checkpoint_missing_scales_is_refused(gpt_oss, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = gpt_oss
    state = load_file(f"{path}/model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    state[f"{name}_blocks"], _ = _quantize_mxfp4(state.pop(name).transpose(1, 2))
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_blocks but no model.layers.1.mlp.experts.down_proj_scales"):
        LLM(str(broken), max_model_len=128, kv_cache_memory_bytes=16 << 20)


@pytest.mark.parametrize("tp,expert_parallel", [(1, False), (2, False), (2, True)])
def test_memory_plan_counts_each_ranks_weights(gpt_oss, monkeypatch, tp, expert_parallel):
    """The plan's per-rank weight bytes equal the parameters the model builds on that rank (biases and sinks
    included)."""
    from kvserve.distributed import parallel_state
    from kvserve.model.registry import model_class
    from kvserve.sizing import memory_plan

    cfg = ModelConfig.from_path(gpt_oss[0])
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.ParallelState(
        rank=tp - 1, world_size=tp, tp_size=tp, expert_parallel=expert_parallel))
    model = model_class(cfg.architecture)(cfg, None, 64)
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    assert memory_plan.weight_bytes(memory_plan.rank_shapes(cfg, tp, 1, expert_parallel)[0], 4) == built


def test_plan_counts_mxfp4_experts_packed():
    from kvserve.sizing.memory_plan import checkpoint_weight_bytes

    tensors = {"model.layers.0.mlp.experts.gate_up_proj_blocks": ("U8", 8 * 64 * 2 * 16),  # [E, 2I, H/32, 16]
               "model.layers.0.mlp.experts.gate_up_proj_scales": ("U8", 8 * 64 * 2),
               "model.layers.0.mlp.experts.gate_up_proj_bias": ("BF16", 8 * 64)}
    assert checkpoint_weight_bytes(tensors, 2, False) == 8 * 64 * 2 * 16 + 8 * 64 * 2 + 8 * 64 * 2


@pytest.mark.parametrize("tp,expert_parallel", [(1, False), (2, False), (2, True)])
def test_memory_plan_counts_each_ranks_mxfp4_experts(mxfp4_checkpoint, monkeypatch, tp, expert_parallel):
    """With MXFP4 experts the plan's per-rank weight bytes equal what the model builds on that rank: packed
    experts (TP=1, expert parallel), or dequantized ones where a rank's share cuts a group (TP=2 here)."""
    from kvserve.distributed import parallel_state
    from kvserve.model.quantization.mxfp4 import Mxfp4Config
    from kvserve.model.registry import model_class
    from kvserve.sizing import memory_plan

    cfg = ModelConfig.from_path(mxfp4_checkpoint[0])
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.ParallelState(
        rank=tp - 1, world_size=tp, tp_size=tp, expert_parallel=expert_parallel))
    model = model_class(cfg.architecture)(cfg, None, 64, quant_config=Mxfp4Config())
    experts = model.layers[0].mlp.experts
    assert experts.mxfp4_packed == (tp == 1 or expert_parallel)
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    fmt = memory_plan.weights_format(Mxfp4Config())
    assert fmt == {"quantization": None, "quantized_at_load": False, "experts_quantization": "mxfp4"}
    shape = memory_plan.rank_shapes(cfg, tp, 1, expert_parallel)[0]
    assert memory_plan.weight_bytes(shape, 4, None, fmt["experts_quantization"]) == built


def test_mxfp4_dummy_weights_are_small_and_finite(mxfp4_checkpoint):
    """load_format="dummy" on an MXFP4 config fills the packed experts with random E2M1 bytes under small E8M0
    scales (weights up to about 1e-2, as the float dummy's), not random scales that overflow."""
    llm = LLM(mxfp4_checkpoint[0], load_format="dummy", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    try:
        experts = llm.llm_engine.executor.worker.runner.model.layers[0].mlp.experts
        w13 = experts.w13_weight.float()  # the CPU path: dequantized after loading
        assert torch.isfinite(w13).all() and 0 < w13.abs().max() <= 6 * 2.0**-9
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == MAX_TOKENS
    finally:
        llm.llm_engine.shutdown()
