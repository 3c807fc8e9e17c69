"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral): greedy tokens identical to HF transformers on the
same tiny random checkpoints (fp32, CPU), also with chunked prefill, prefix-cache hits and preemption in one
run, and with tensor parallelism (experts split) and expert parallelism (whole experts per rank) at TP=2."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.model_config import ModelConfig
from tests.conftest import TINY_VOCAB, hf_greedy, random_prompts

COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2,
              bos_token_id=1, initializer_range=0.1)  # wide weights: varied routing, tokens that are not all equal


def _hf_config(arch: str):
    import transformers

    if arch == "qwen2_moe":  # shared expert behind a sigmoid gate, top-k not renormalised, a dense layer
        return transformers.Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=False, mlp_only_layers=[2])
    if arch == "qwen3_moe":  # q/k norm, renormalised top-4 of 16, every second layer sparse
        return transformers.Qwen3MoeConfig(**COMMON, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                                           num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                                           decoder_sparse_step=2)
    if arch == "mixtral":
        return transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    raise ValueError(arch)


ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral"]
_BUILT: dict = {}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, smol_tokenizer):
    import transformers

    def make(arch: str):
        if arch not in _BUILT:
            torch.manual_seed(97)
            model = transformers.AutoModelForCausalLM.from_config(_hf_config(arch)).eval()
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            smol_tokenizer.save_pretrained(path)
            _BUILT[arch] = (str(path), model)
        return _BUILT[arch]

    return make


def test_config_reads_the_moe_fields(moe_model):
    qwen2 = ModelConfig.from_path(moe_model("qwen2_moe")[0])
    assert (qwen2.num_experts, qwen2.num_experts_per_tok, qwen2.shared_expert_intermediate_size) == (8, 2, 48)
    assert qwen2.attention_bias and not qwen2.norm_topk_prob and qwen2.mlp_only_layers == [2]
    qwen3 = ModelConfig.from_path(moe_model("qwen3_moe")[0])
    assert qwen3.qk_norm and qwen3.norm_topk_prob and qwen3.num_experts == 16
    assert [qwen3.is_moe_layer(i) for i in range(3)] == [False, True, False]  # decoder_sparse_step 2
    mixtral = ModelConfig.from_path(moe_model("mixtral")[0])
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 32 and mixtral.num_moe_layers == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_num_params_counts_every_expert_and_active_only_top_k(moe_model, arch):
    path, hf_model = moe_model(arch)
    cfg = ModelConfig.from_path(path)
    assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters())
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = cfg.num_moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    assert cfg.num_active_params() == cfg.num_params() - idle


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_models_match_hf(moe_model, arch):
    path, hf_model = moe_model(arch)
    prompts = random_prompts(8, 1, 120, seed=len(arch))
    llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=32 << 20)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = hf_greedy(hf_model, prompts, 12)
    assert len({tuple(e) for e in expected}) > 1  # the oracle is not degenerate
    for prompt, out, exp in zip(prompts, outs, expected):
        assert out.outputs[0].token_ids == exp, f"prompt of {len(prompt)} tokens"


MAX_TOKENS = 6
# Prompts 0 and 1 share two full blocks (a prefix hit for 1); 40+ tokens exceed the 32-token budget (chunked
# prefill); 5 blocks of 16 cannot hold all three at once (a preemption).
ENGINE = dict(max_model_len=80, block_size=16, num_gpu_blocks_override=5, max_num_batched_tokens=32, max_num_seqs=3,
              enable_chunked_prefill=True, enable_prefix_caching=True)


def _scheduling_prompts() -> list[list[int]]:
    base = random_prompts(3, 36, 44, seed=7)
    return [base[0], base[0][:32] + base[1][:9], base[2]]


def _run(path: str, **parallel):
    tokens, _, stats = _run_with_logprobs(path, **parallel)
    return tokens, stats


def _run_with_logprobs(path: str, **parallel):
    """(greedy tokens, each one's logprob, stats) of the scheduling prompts."""
    llm = LLM(path, **ENGINE, **parallel)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in _scheduling_prompts()],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
        completions = [o.outputs[0] for o in outs]
        return ([c.token_ids for c in completions],
                [[entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)] for c in completions],
                llm.llm_engine.get_stats())
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_with_chunked_prefill_prefix_hits_and_preemption_matches_hf(moe_model, arch):
    path, hf_model = moe_model(arch)
    tokens, stats = _run(path)
    assert tokens == hf_greedy(hf_model, _scheduling_prompts(), MAX_TOKENS)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(tensor_parallel_size=2, enable_expert_parallel=True)], ids=["tp2", "ep2"])
def test_moe_tensor_and_expert_parallel_match_tp1(moe_model, arch, parallel):
    path, hf_model = moe_model(arch)
    tokens, stats = _run(path, **parallel)
    assert tokens == hf_greedy(hf_model, _scheduling_prompts(), MAX_TOKENS)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


def test_moe_pipeline_parallel_matches_hf(moe_model):
    """Two stages over Qwen3-MoE's sparse and dense layers (decoder_sparse_step 2)."""
    path, hf_model = moe_model("qwen3_moe")
    tokens, stats = _run(path, pipeline_parallel_size=2)
    assert tokens == hf_greedy(hf_model, _scheduling_prompts(), MAX_TOKENS)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


def test_deepseek_v2_is_refused_with_what_is_missing():
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}
    with pytest.raises(ValueError, match="group-limited routing.*Supported: .*GptOssForCausalLM"):
        ModelConfig.from_hf_dict(cfg)


@pytest.mark.parametrize("experts,ranks", [(8, 2), (10, 4), (3, 3)])
def test_expert_placement_gives_every_expert_one_rank(experts, ranks):
    from kvserve.model.moe import expert_placement

    owned = []
    for rank in range(ranks):
        first, count = expert_placement(experts, ranks, rank)
        assert count in (experts // ranks, experts // ranks + 1)
        owned += range(first, first + count)
    assert owned == list(range(experts))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_rank_holds_split_experts_or_whole_ones(monkeypatch, expert_parallel):
    from kvserve.distributed import parallel_state
    from kvserve.model.moe import FusedMoE

    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.ParallelState(
        rank=1, world_size=2, tp_size=2, expert_parallel=expert_parallel))
    moe = FusedMoE(num_experts=8, hidden=64, intermediate=32)
    if expert_parallel:  # experts 4..7, whole
        assert (moe.first_expert, moe.num_local_experts) == (4, 4)
        assert moe.w13_weight.shape == (4, 64, 64) and moe.w2_weight.shape == (4, 64, 32)
        assert moe.expert_map.tolist() == [-1] * 4 + [0, 1, 2, 3]
    else:  # all 8 experts, half of each one's intermediate features
        assert moe.w13_weight.shape == (8, 32, 64) and moe.w2_weight.shape == (8, 64, 16)
        assert moe.expert_map is None


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_online_fp8_quantizes_experts_and_matches_hf_on_the_same_fp8_weights(moe_model, arch, tmp_path):
    """--quantization fp8: every expert (and the attention, dense and shared MLPs) becomes per-channel e4m3 at
    load; HF on a checkpoint holding exactly those dequantized weights is the oracle."""
    import re
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    from kvserve.ops.fp8_e4m3 import quantize_per_channel

    path, _ = moe_model(arch)
    weights = load_file(f"{path}/model.safetensors")
    for name, w in weights.items():
        if re.search(r"(_proj|\.w[123])\.weight$", name):  # not the routers, norms, embedding or head
            q, scale = quantize_per_channel(w)
            weights[name] = q.float() * scale[:, None]
    ddir = tmp_path / "dequantized"
    shutil.copytree(path, ddir)
    save_file(weights, str(ddir / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    prompts = random_prompts(4, 1, 60, seed=5)
    llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=16 << 20, quantization="fp8")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    experts = llm.llm_engine.executor.runner.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.float8_e4m3fn
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, prompts, 8)


def _serve_quantized_as_hf_does(qdir, ddir, quantization_config: dict | None = None):
    """qdir's config.json gets quantization_config (None: it has one); kvserve serving qdir gives HF's greedy
    tokens on ddir (the dequantized weights). Returns the LLM."""
    import json

    import transformers

    if quantization_config is not None:
        config = json.loads((qdir / "config.json").read_text())
        (qdir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    prompts = random_prompts(4, 1, 60, seed=5)
    llm = LLM(str(qdir), max_model_len=256, kv_cache_memory_bytes=16 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, prompts, 8)
    return llm


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
@pytest.mark.parametrize("method", ["fp8", "compressed-tensors"])
def test_fp8_checkpoint_experts_load_as_stored_and_match_hf_on_the_dequantized_weights(moe_model, arch, method,
                                                                                         tmp_path):
    """An fp8 checkpoint (HF fp8: one scale per tensor; compressed-tensors: one per output channel) with e4m3
    experts, attention and dense / shared MLPs: loaded as stored, not requantized; HF on the dequantized weights
    is the oracle."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.quant_utils import quant_config_for, quantize_fp8

    path, _ = moe_model(arch)
    weights = load_file(f"{path}/model.safetensors")
    stored, dequantized = {}, {}
    for name, w in weights.items():
        stored[name] = dequantized[name] = w
        if re.search(r"(_proj|\.w[123])\.weight$", name):  # not the routers, norms, embedding or head
            q, scale, deq = quantize_fp8(w, per_channel=method == "compressed-tensors")
            stored[name], stored[name[: -len("weight")] + "weight_scale"] = q, scale
            dequantized[name] = deq
    qdir, ddir = tmp_path / "fp8", tmp_path / "dequantized"
    for out, tensors in ((qdir, stored), (ddir, dequantized)):
        shutil.copytree(path, out)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    llm = _serve_quantized_as_hf_does(qdir, ddir, quant_config_for(method, per_channel=True))
    experts = llm.llm_engine.executor.runner.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.float8_e4m3fn
    first = next(n for n in stored if re.search(r"experts\.0\.(gate_proj|w1)\.weight$", n))
    assert torch.equal(experts.w13_weight[0, :experts.intermediate].view(torch.uint8),
                       stored[first].view(torch.uint8))  # the checkpoint's bytes, not requantized


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_block_fp8_checkpoint_is_dequantized_as_read_and_matches_hf(moe_model, arch, tmp_path, capsys):
    """A block-wise FP8 checkpoint (weight_block_size [16, 24]: blocks ragged at the edges), its scales in another
    shard than their weights: served dequantized, greedy tokens equal HF on the dequantized weights; the plan
    counts the weights in the serving dtype."""
    import json

    from kvserve.entrypoints.cli import main as cli_main
    from tests.quant_utils import write_block_fp8_pair

    path, _ = moe_model(arch)
    qdir, ddir = write_block_fp8_pair(path, tmp_path, (16, 24), scales_apart=True)
    llm = _serve_quantized_as_hf_does(qdir, ddir)
    served = llm.llm_engine.executor.worker.weights_bytes
    llm.llm_engine.shutdown()
    assert cli_main(["plan", str(qdir), "--max-model-len", "256", "--gpu", "H100", "--dtype", "float32", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["weights_source"] == "checkpoint"
    assert abs(plan["ranks"][0]["weights"] - served) < 0.01 * served  # the rotary table apart


def test_block_fp8_pairs_are_checked():
    from kvserve.model.quantization.fp8_block import dequantized_weights

    q = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"lacks one of the pair"):
        list(dequantized_weights([("a.weight", q)], {"a.weight"}, (2, 2), torch.float32, "cpu"))
    with pytest.raises(ValueError, match=r"a.weight: weight_scale_inv of shape \(1, 1\) does not match"):
        list(dequantized_weights([("a.weight", q), ("a.weight_scale_inv", torch.ones(1, 1))], {"a.weight"}, (2, 2),
                                 torch.float32, "cpu"))
    with pytest.raises(ValueError, match=r"must be float8_e4m3fn"):
        list(dequantized_weights([("a.weight_scale_inv", torch.ones(2, 2)), ("a.weight", q.float())], {"a.weight"},
                                 (2, 2), torch.float32, "cpu"))


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_expert_scales_land_on_this_ranks_rows(monkeypatch, expert_parallel, per_channel):
    """At TP rank 1 of 2: split experts take their half of each gate / up scale's rows, whole experts (expert
    parallelism) all of them; a per-tensor scale covers every row of its projection."""
    from kvserve.distributed import parallel_state
    from kvserve.model.moe import FusedMoE
    from kvserve.model.quantization.fp8_moe import Fp8CheckpointMoEMethod

    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.ParallelState(
        rank=1, world_size=2, tp_size=2, expert_parallel=expert_parallel))
    moe = FusedMoE(num_experts=4, hidden=8, intermediate=6, quant_method=Fp8CheckpointMoEMethod())
    expert, inter = 3, moe.intermediate
    scales = {shard: (torch.arange(n, dtype=torch.float32) + 10 * (k + 1))[:, None] if per_channel
              else torch.tensor(float(k + 1)) for k, (shard, n) in enumerate((("gate", 6), ("up", 6), ("down", 8)))}
    for shard, scale in scales.items():
        param = moe.w2_weight_scale if shard == "down" else moe.w13_weight_scale
        assert moe.weight_loader(param, scale, shard, expert)
    local = expert - moe.first_expert
    rows = slice(0, 6) if expert_parallel else slice(3, 6)  # rank 1's features when each expert is split
    for shard, offset in (("gate", 0), ("up", inter)):
        want = scales[shard].reshape(-1)[rows] if per_channel else scales[shard].expand(inter)
        assert torch.equal(moe.w13_weight_scale[local, offset:offset + inter], want)
    want = scales["down"].reshape(-1) if per_channel else scales["down"].expand(8)
    assert torch.equal(moe.w2_weight_scale[local], want)
    with pytest.raises(ValueError, match="expected one per tensor or one per output channel"):
        moe.weight_loader(moe.w13_weight_scale, torch.ones(5, 1), "gate", expert)


def test_quantized_int_checkpoint_experts_are_refused_with_the_alternative():
    from kvserve.model.quantization.awq import AWQConfig

    with pytest.raises(ValueError, match="mixture-of-experts"):
        AWQConfig.from_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
                              ).get_moe_method("layers.0.mlp.experts")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp,expert_parallel", [(1, False), (2, False), (2, True)])
def test_memory_plan_counts_each_ranks_moe_weights(moe_model, monkeypatch, arch, tp, expert_parallel):
    """The plan's per-rank weight bytes equal the parameters the model builds on that rank."""
    from kvserve.distributed import parallel_state
    from kvserve.model.registry import model_class
    from kvserve.sizing import memory_plan

    cfg = ModelConfig.from_path(moe_model(arch)[0])
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.ParallelState(
        rank=tp - 1, world_size=tp, tp_size=tp, expert_parallel=expert_parallel))
    model = model_class(cfg.architecture)(cfg, None, 64)
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    assert memory_plan.weight_bytes(memory_plan.rank_shapes(cfg, tp, 1, expert_parallel)[0], 4) == built


_TRITON_SCRIPT = r"""
import json, sys
from kvserve import LLM, SamplingParams
from kvserve.model.quantization import fp8_moe
from kvserve.ops import fused_moe
path, kwargs, prompts, max_tokens, fp8_moe_paths = json.loads(sys.stdin.read())
if fp8_moe_paths is not None:
    fp8_moe.FP8_MOE_PATHS = tuple(fp8_moe.Fp8MoEPath(*p) for p in fp8_moe_paths)
w8a8_steps, real = [], fused_moe.fused_moe_triton
def counted(*args, quantize_activations=False, **kw):
    w8a8_steps.append(quantize_activations)
    return real(*args, quantize_activations=quantize_activations, **kw)
fused_moe.fused_moe_triton = counted
llm = LLM(path, attention_backend="triton", **kwargs)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0), use_tqdm=False)
s = llm.llm_engine.get_stats()
llm.llm_engine.shutdown()
done = [o.outputs[0] for o in outs]
print(json.dumps({"tokens": [c.token_ids for c in done], "preemptions": s.num_preemptions,
                  "logprobs": [[e[t].logprob for t, e in zip(c.token_ids, c.logprobs)] for c in done],
                  "prefix_hits": s.prefix_cache_hits, "w8a8_calls": [sum(w8a8_steps), len(w8a8_steps)]}))
"""


def _run_triton_in_interpreter(path: str, kwargs: dict, fp8_moe_paths=None) -> dict:
    """The GPU code path (Triton attention, fused kernels, the grouped-GEMM experts) on the CPU under Triton's
    interpreter, in a subprocess (the interpreter must be on before triton is imported), on the scheduling
    prompts; fp8_moe_paths replaces fp8_moe.FP8_MOE_PATHS there. Its tokens (and their logprobs), stats and
    how many fused-MoE calls were W8A8 (of all)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    payload = json.dumps([path, kwargs, _scheduling_prompts(), MAX_TOKENS, fp8_moe_paths])
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], input=payload, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).resolve().parents[2],
                          timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_fused_moe_path_in_the_engine_matches_hf(moe_model):
    """The Triton path at TP=2 with expert parallelism (each rank's experts, the others' rows zero), with
    chunked prefill, a prefix hit and a preemption: the same greedy tokens as HF. (Interpreted: ~80 s.)"""
    path, hf_model = moe_model("qwen3_moe")
    run = _run_triton_in_interpreter(path, {**ENGINE, "tensor_parallel_size": 2, "enable_expert_parallel": True})
    assert run["preemptions"] > 0 and run["prefix_hits"] > 0
    assert run["tokens"] == hf_greedy(hf_model, _scheduling_prompts(), MAX_TOKENS)


# Weight-only for steps of up to 8 tokens (decode here: at most 3 sequences), W8A8 for the prefill chunks.
_FP8_MOE_TEST_PATHS = ((8, "w8a16"), (1 << 62, "w8a8"))
# Triton (interpreted, fp32) against the torch reference: sums in another order. Weight-only experts in the
# prefill move the logprobs by far more than this (checked below), so the check sees which math ran.
_LOGPROB_TOL = 1e-4


def test_triton_fp8_experts_w8a8_in_the_engine_match_the_torch_reference(moe_model, monkeypatch):
    """--quantization fp8 through the Triton path (interpreted) with a selection table that sends the prefill
    chunks to W8A8 and the decode steps to weight-only, with chunked prefill, a prefix hit and a preemption: the
    same greedy tokens and logprobs as the torch reference path (CPU, in this process) following the same
    table, which quantizes the activations the same way. Both runs take both paths. (Interpreted: ~60 s.)"""
    from kvserve.model.quantization import fp8_moe
    from kvserve.ops import fused_moe

    path, _ = moe_model("qwen3_moe")
    run = _run_triton_in_interpreter(path, {**ENGINE, "quantization": "fp8"}, _FP8_MOE_TEST_PATHS)
    assert 0 < run["w8a8_calls"][0] < run["w8a8_calls"][1]
    assert run["preemptions"] > 0 and run["prefix_hits"] > 0

    monkeypatch.setattr(fp8_moe, "fp8_dot_available", lambda w: True)  # the reference follows the table too
    w8a8_steps, real = [], fused_moe.fused_moe_torch

    def counted(*args, quantize_activations=False, **kw):
        w8a8_steps.append(quantize_activations)
        return real(*args, quantize_activations=quantize_activations, **kw)

    monkeypatch.setattr(fused_moe, "fused_moe_torch", counted)
    runs = {}
    for name, table in (("table", _FP8_MOE_TEST_PATHS), ("weight_only", ((1 << 62, "w8a16"),))):
        monkeypatch.setattr(fp8_moe, "FP8_MOE_PATHS", tuple(fp8_moe.Fp8MoEPath(*p) for p in table))
        w8a8_steps.clear()
        runs[name] = _run_with_logprobs(path, quantization="fp8")
        if name == "table":
            assert 0 < sum(w8a8_steps) < len(w8a8_steps)
    tokens, logprobs, _ = runs["table"]
    assert run["tokens"] == tokens
    gap = lambda a, b: max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))  # noqa: E731
    assert gap(run["logprobs"], logprobs) < _LOGPROB_TOL
    assert runs["weight_only"][0] != tokens or gap(runs["weight_only"][1], logprobs) > 10 * _LOGPROB_TOL


def _write_gguf(hf_model, gguf_arch: str, path) -> None:
    """The HF model as llama.cpp's converter lays it out (F32): per-layer names, experts stacked [E, out, in],
    llama's q/k rows interleaved for its rope. Read from what save_pretrained writes (one tensor per expert;
    transformers 5 holds them fused in memory)."""
    import tempfile

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from kvserve.model import gguf_loader

    cfg = hf_model.config
    to_gguf = {v: k for k, v in {**gguf_loader._LAYER_TENSORS, **gguf_loader._EXPERT_TENSORS}.items()}
    mixtral = {"block_sparse_moe.gate": "mlp.gate", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for key, value in (("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("block_count", cfg.num_hidden_layers), ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads), ("attention.key_length", head_dim),
                       ("context_length", cfg.max_position_embeddings), ("vocab_size", cfg.vocab_size),
                       ("expert_count", experts), ("expert_used_count", cfg.num_experts_per_tok),
                       ("expert_feed_forward_length", getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))):
        writer.add_uint32(f"{gguf_arch}.{key}", value)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        writer.add_uint32(f"{gguf_arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
    writer.add_float32(f"{gguf_arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{gguf_arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        state = load_file(f"{tmp}/model.safetensors")
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            writer.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
                               "output_norm.weight", "lm_head.weight": "output.weight"}[name], w)
            continue
        _, _, layer, rest = name.split(".", 3)
        for old, new in mixtral.items():
            rest = rest.replace(f"{old}.", f"{new}.")
        rest = rest.replace("block_sparse_moe.experts.", "mlp.experts.")
        if rest.startswith("mlp.experts."):
            _, _, e, proj, _ = rest.split(".")
            stacks.setdefault((int(layer), to_gguf[proj]), {})[int(e)] = w
            continue
        module, suffix = rest.rsplit(".", 1)
        if gguf_arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):  # llama.cpp's permute
            heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if module == "mlp.shared_expert_gate":
            w = w.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is a vector
        writer.add_tensor(f"blk.{layer}.{to_gguf[module]}.{suffix}", w)
    for (layer, kind), per_expert in stacks.items():
        writer.add_tensor(f"blk.{layer}.{kind}.weight", np.stack([per_expert[e] for e in sorted(per_expert)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,gguf_arch", [("qwen2_moe", "qwen2moe"), ("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_moe_gguf_matches_hf(moe_model, tmp_path, arch, gguf_arch):
    """A GGUF of each MoE family (llama.cpp's names, experts stacked; every layer sparse, as llama.cpp requires)
    gives HF's greedy tokens of the same weights."""
    import transformers

    hf_dir, _ = moe_model(arch)
    overrides = {"mlp_only_layers": [], "decoder_sparse_step": 1} if arch != "mixtral" else {}
    torch.manual_seed(5)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        type(_hf_config(arch))(**{**_hf_config(arch).to_dict(), **overrides})).eval()
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(hf_model, gguf_arch, path)
    cfg = ModelConfig.from_path(path)
    assert cfg.architecture == hf_model.config.architectures[0] and cfg.num_moe_layers == 3
    prompts = random_prompts(4, 1, 60, seed=3)
    llm = LLM(str(path), tokenizer=hf_dir, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_model, prompts, 8)
