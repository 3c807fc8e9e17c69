"""--kv-cache-dtype fp8: K/V stored as e4m3 with per-tensor scales (torch reference backend on CPU; the
Triton kernels are checked against it in test_quant_kernels.py).

Tolerances, and why: e4m3 keeps 3 mantissa bits (relative error up to 1/16 per element), so attention
outputs move by a few percent and logprobs by ~1e-2 at most on the tiny model (measured: <= 0.007). The
tiny random model's next-token distribution is nearly flat over 49k tokens, so such moves flip some greedy
argmaxes, and one flip changes the rest of that sequence: greedy agreement is only required to be
mostly the same (>= 70% of tokens; measured ~80%), while the teacher-forced prompt logprobs, which
cannot diverge, must stay within 0.03 of the 16-bit-cache run and must not be bit-identical (the cache
really is fp8)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import random_prompts


def _llm(path, **kw):
    return LLM(path, max_model_len=256, kv_cache_memory_bytes=8 << 20, **kw)


def _prompt_logprobs(outs):
    return torch.tensor([next(iter(d.values())).logprob if len(d) == 1 else d[tok].logprob
                         for o in outs for tok, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])])


@pytest.fixture(scope="module")
def runs(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, 5, 100, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    out = {}
    for kv in ("auto", "fp8"):
        llm = _llm(path, kv_cache_dtype=kv)
        out[kv] = (llm, llm.generate(prompts, params, use_tqdm=False))
    return out


def test_fp8_kv_cache_stays_close_to_the_16bit_cache(runs):
    (_, auto), (llm, fp8) = runs["auto"], runs["fp8"]
    assert all(c.dtype == torch.float8_e4m3fn for c in llm.llm_engine.executor.runner.kv_caches)
    diff = (_prompt_logprobs(auto) - _prompt_logprobs(fp8)).abs()
    assert 0 < diff.max() < 0.03, diff.max()
    pairs = [(x, y) for a, b in zip(auto, fp8) for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids)]
    agree = sum(x == y for x, y in pairs) / len(pairs)
    assert agree >= 0.7, agree


def test_fp8_kv_cache_holds_more_tokens_and_says_so(tiny_model_factory, caplog):
    path, _ = tiny_model_factory("llama")
    with caplog.at_level(logging.INFO, logger="kvserve.worker.memory"):
        auto = _llm(path)
        fp8 = _llm(path, kv_cache_dtype="fp8_e4m3")
    # Same bytes, 1-byte elements instead of the fp32 CPU cache's 4 (2x against a bf16 cache).
    assert fp8.llm_engine.executor.runner.num_blocks == 4 * auto.llm_engine.executor.runner.num_blocks
    lines = [r.getMessage() for r in caplog.records if "KV cache size" in r.getMessage()]
    assert any("(dtype float32)" in m for m in lines) and any("(dtype fp8_e4m3)" in m for m in lines), lines


def test_calculate_kv_scales_from_the_first_batch(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    llm = _llm(path, kv_cache_dtype="fp8", calculate_kv_scales=True)
    attn = [layer.self_attn for layer in llm.llm_engine.executor.runner.model.layers]
    assert all(a.k_scale.item() == 1.0 for a in attn)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, 20, 40, seed=1)], params, use_tqdm=False)
    scales = [(a.k_scale.item(), a.v_scale.item()) for a in attn]
    # vLLM's rule: max |k| / 200 and max |v| / 100 of the first batch; the tiny model's |k| is well below 200.
    assert all(0 < k < 0.1 and 0 < v < 0.1 for k, v in scales), scales
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, 20, 40, seed=2)], params, use_tqdm=False)
    assert scales == [(a.k_scale.item(), a.v_scale.item()) for a in attn]  # computed once


def test_kv_scales_come_from_the_checkpoint(tiny_model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    src, _ = tiny_model_factory("llama")
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.02)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.03)
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([0.04])
    save_file(tensors, str(dst / "model.safetensors"))
    llm = _llm(str(dst), kv_cache_dtype="fp8")
    layers = llm.llm_engine.executor.runner.model.layers
    assert layers[0].self_attn.k_scale.item() == pytest.approx(0.02)
    assert layers[0].self_attn.v_scale.item() == pytest.approx(0.03)
    assert layers[1].self_attn.k_scale.item() == pytest.approx(0.04)
    assert layers[1].self_attn.v_scale.item() == 1.0


def test_bad_kv_cache_dtype_is_rejected():
    with pytest.raises(ValueError, match=r"--kv-cache-dtype: 'int8' is not one of auto, fp8, fp8_e4m3"):
        LLM(kv_cache_dtype="int8")
