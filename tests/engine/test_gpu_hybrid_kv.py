"""Interleaved local/global attention on a GPU (the gpu tier: `pytest -m gpu`, skipped without CUDA): a
Gemma-3-shaped tiny random model (12 layers, 5 windowed : 1 full, so 6 KV cache groups of 2 layers sharing
2 KV tensors) on the Triton backend, prompts longer than the window. Against HF on the same GPU (fp32:
identical, or split where HF's top-2 logits nearly tie), and against itself: CUDA graphs (decode and mixed
steps, each group's tables staged) == eager, and a KV cache so small that requests are preempted (swap and
recompute) == a large one (in fp32)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.engine.test_gpu_engine import _assert_same_or_split_at_tie, _hf_greedy, _prompts
from tests.gpu_tier import ENGINE_TIER, GPU_TEST_MEMORY_UTILIZATION

pytestmark = ENGINE_TIER

WINDOW = 64


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, sliding_window=WINDOW,
        sliding_window_pattern=6, query_pre_attn_scalar=64, tie_word_embeddings=True, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path_factory.mktemp("gpu-tiny-gemma3")
    model.save_pretrained(path)
    return str(path)


def _run(path, prompts, dtype="float32", **kw):
    from kvserve import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_model_len=1024, gpu_memory_utilization=GPU_TEST_MEMORY_UTILIZATION, skip_tokenizer_init=True,
              attention_backend="triton", **kw)
    kv = llm.llm_engine.kv_cache_manager
    assert len(kv.groups) == 6 and sum(w is None for w in kv.group_windows) == 1
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    stats = llm.llm_engine.get_stats()
    assert kv.pool.num_free_blocks == kv.num_blocks
    del llm, outs, kv
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, stats


def test_gemma3_shape_vs_hf_on_gpu(tiny_gemma3_dir):
    import transformers

    prompts = _prompts(6, 32000, seed=7, lo=WINDOW + 10, hi=400)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).to("cuda").eval()
    expected, margins = _hf_greedy(hf, prompts)
    del hf
    torch.cuda.empty_cache()
    got, _ = _run(tiny_gemma3_dir, prompts, enforce_eager=True)
    _assert_same_or_split_at_tie(expected, margins, got, torch.float32)


def test_gemma3_shape_graphs_and_preemption_agree(tiny_gemma3_dir):
    prompts = _prompts(8, 32000, seed=8, lo=WINDOW + 10, hi=500)
    eager, _ = _run(tiny_gemma3_dir, prompts, "bfloat16", enforce_eager=True)
    graphs, _ = _run(tiny_gemma3_dir, prompts, "bfloat16")
    assert graphs == eager
    chunks = dict(max_num_batched_tokens=64, max_num_seqs=8)
    chunked, _ = _run(tiny_gemma3_dir, prompts, "bfloat16", **chunks)
    assert chunked == _run(tiny_gemma3_dir, prompts, "bfloat16", enforce_eager=True, **chunks)[0]
    # One request of 1024 tokens in chunks of 64 holds 64 blocks in the full group and cdiv(63 + 64, 16) + 1 = 9
    # in each windowed one: 109 blocks; 8 requests of ~270 tokens growing by 32 need more than 120. Preempted
    # requests run in other batch shapes (a recompute's prefill covers its generated tokens too), so this part
    # compares in fp32, where a bf16 rounding cannot tip a near-tie.
    reference, _ = _run(tiny_gemma3_dir, prompts, **chunks)
    for mode in ("recompute", "swap"):
        swap = {"preemption_mode": "swap", "swap_space": 0.05} if mode == "swap" else {}
        small, stats = _run(tiny_gemma3_dir, prompts, num_gpu_blocks_override=120, **chunks, **swap)
        assert stats.num_preemptions_by_mode[mode] > 0
        assert small == reference
