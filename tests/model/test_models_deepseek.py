"""DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing, YaRN): greedy tokens identical to HF
transformers (fp32, CPU) on a tiny random DeepseekV3ForCausalLM built with HF's own classes (8 routed experts
in 4 groups, top-2 of the best 2 groups, a shared expert, a dense first layer, q_lora and interleaved rope),
also with chunked prefill, prefix hits and preemption, and TP=2; the KV cache holds the latent, and the memory
plan counts it so."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.model_config import ModelConfig
from tests.conftest import TINY_VOCAB, hf_greedy, random_prompts

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
KV_LORA_RANK, ROPE = 32, 16


def _hf_config(**overrides):
    import transformers

    return transformers.DeepseekV3Config(**{
        "vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
        "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": 48,
        "qk_rope_head_dim": ROPE, "v_head_dim": 24, "qk_nope_head_dim": 32, "n_group": 4, "topk_group": 2,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_mtp_layers": 0, "max_position_embeddings": 512,
        "eos_token_id": 2, "bos_token_id": 1, "initializer_range": 0.1,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                            "rope_theta": 10000.0},
        **overrides})


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, smol_tokenizer):
    import transformers

    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config()).eval()
    with torch.no_grad():  # HF starts the correction bias at zero: make it steer the choice
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("tiny-deepseek-v3")
    model.save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return str(path), model


def _generate(path, prompts, **kwargs):
    llm = LLM(path, **{"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20, **kwargs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()


PROMPTS = random_prompts(6, 1, 100, seed=4)


def test_config_reads_latent_attention_and_routing(deepseek):
    cfg = ModelConfig.from_path(deepseek[0])
    assert cfg.uses_mla and (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank) == (KV_LORA_RANK, ROPE, 48)
    assert cfg.head_dim == 48 and cfg.rope_interleave
    assert (cfg.moe_router, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == ("sigmoid_grouped", 4, 2, 2.5)
    assert cfg.mlp_only_layers == [0] and cfg.shared_expert_intermediate_size == 32 and not cfg.shared_expert_gated
    # The cache holds the latent and the rope key per token and layer, not per-head K and V.
    assert cfg.kv_bytes_per_token(4) == 3 * (KV_LORA_RANK + ROPE) * 4


def test_num_params_counts_what_hf_holds(deepseek):
    path, hf_model = deepseek
    held = sum(p.numel() for p in hf_model.parameters())
    held += sum(b.numel() for n, b in hf_model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert ModelConfig.from_path(path).num_params() == held


def test_matches_hf(deepseek):
    path, hf_model = deepseek
    expected = hf_greedy(hf_model, PROMPTS, MAX_TOKENS)
    assert len({tuple(e) for e in expected}) > 1
    tokens, _ = _generate(path, PROMPTS, enable_prefix_caching=False)
    assert tokens == expected


def _scheduling_prompts() -> list[list[int]]:
    base = random_prompts(3, 36, 44, seed=7)
    return [base[0], base[0][:32] + base[1][:9], base[2]]


# Prompt 1 shares two full blocks of prompt 0 (a prefix hit); 40+ tokens exceed the 32-token budget (chunked
# prefill); 5 blocks of 16 cannot hold all three (a preemption).
ENGINE = dict(max_model_len=80, block_size=16, num_gpu_blocks_override=5, max_num_batched_tokens=32, max_num_seqs=3,
              enable_chunked_prefill=True, enable_prefix_caching=True)


def test_matches_hf_with_chunked_prefill_prefix_hits_and_preemption(deepseek):
    path, hf_model = deepseek
    tokens, stats = _generate(path, _scheduling_prompts(), **ENGINE)
    assert tokens == hf_greedy(hf_model, _scheduling_prompts(), MAX_TOKENS)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


def test_tensor_parallel_matches_tp1(deepseek):
    path, hf_model = deepseek
    tokens, stats = _generate(path, _scheduling_prompts(), **ENGINE, tensor_parallel_size=2)
    assert tokens == hf_greedy(hf_model, _scheduling_prompts(), MAX_TOKENS)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


def test_kv_cache_is_the_latent(deepseek):
    llm = LLM(deepseek[0], max_model_len=128, kv_cache_memory_bytes=16 << 20)
    caches = llm.llm_engine.executor.runner.kv_caches
    assert len(caches) == 3 and caches[0].shape[0] == 2
    assert tuple(caches[0].shape[3:]) == (1, (KV_LORA_RANK + ROPE) // 2)


def test_triton_backend_is_refused_with_the_alternative(deepseek):
    with pytest.raises(ValueError, match="torch backend only"):
        LLM(deepseek[0], max_model_len=128, attention_backend="triton")


@pytest.mark.parametrize("tp,expert_parallel", [(1, False), (2, False), (2, True)])
def test_memory_plan_counts_each_ranks_weights(deepseek, monkeypatch, tp, expert_parallel):
    """The plan's per-rank weight bytes equal the parameters the model builds on that rank (latent attention,
    fp32 router, ungated shared expert, a dense first layer)."""
    from kvserve.distributed import parallel_state
    from kvserve.model.registry import model_class
    from kvserve.sizing import memory_plan

    cfg = ModelConfig.from_path(deepseek[0])
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.ParallelState(
        rank=tp - 1, world_size=tp, tp_size=tp, expert_parallel=expert_parallel))
    model = model_class(cfg.architecture)(cfg, None, 64)
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = memory_plan.rank_shapes(cfg, tp, 1, expert_parallel)[0]
    assert memory_plan.weight_bytes(shape, 4) == built
    assert memory_plan.kv_bytes_per_token(shape, 2) == 3 * (KV_LORA_RANK + ROPE) * 2  # replicated on every rank
