"""Windowed attention and the Gemma, Phi-3, Granite, OLMo 2 and Cohere families: greedy tokens identical to
HF transformers (fp32) on tiny random models built with HF's own classes, over prompts longer than the
window (tests/conftest.py: WINDOW), with chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.model_config import ModelConfig
from tests.conftest import WINDOW, hf_greedy, random_prompts

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ARCHS = ["mistral-window", "qwen2-window", "gemma2", "gemma3", "phi3", "phi3-longrope", "granite", "olmo2", "cohere",
         "cohere2"]


def _generate(path, prompts, **kwargs) -> tuple[list[list[int]], object]:
    llm = LLM(path, **{"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20, **kwargs})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine


def _shared_prefix_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 40000) for _ in range(rng.randint(50, 90))] for _ in range(2)]
    return [prefixes[i % 2] + [rng.randrange(3, 40000) for _ in range(rng.randint(1, 30))] for i in range(6)]


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tiny_model_factory):
    path, hf_model = tiny_model_factory(request.param)
    prompts = random_prompts(6, WINDOW + 1, 4 * WINDOW, seed=len(request.param)) + _shared_prefix_prompts(7)
    return path, prompts, hf_greedy(hf_model, prompts, MAX_TOKENS)


def test_matches_hf(model):
    path, prompts, expected = model
    assert min(len(p) for p in prompts) > WINDOW  # (Granite and OLMo 2 have no window: full attention)
    tokens, _ = _generate(path, prompts, enable_prefix_caching=False)
    assert tokens == expected


def test_matches_hf_with_chunks_prefix_hits_and_preemption(model):
    path, prompts, expected = model
    # Chunks of 20 tokens (shorter than the window), prefix caching on, few blocks of 16 for 12 requests
    # (fewer where every layer is windowed: those requests free their old blocks as they go).
    groups = ModelConfig.from_path(path).kv_cache_groups
    all_windowed = len(groups) == 1 and groups[0].window is not None
    # One request of 160 tokens in chunks of 20 holds 10 blocks in a full group, cdiv(23 + 20, 16) + 1 = 4
    # in a windowed one.
    one_request = sum(10 if g.window is None else 4 for g in groups)
    tokens, engine = _generate(path, prompts, max_num_batched_tokens=20, max_num_seqs=6,
                               num_gpu_blocks_override=8 if all_windowed else max(18, one_request), max_model_len=160)
    assert tokens == expected
    stats = engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


def test_window_frees_blocks_and_max_model_len_beyond_the_window(tiny_model_factory):
    """An all-windowed model (Mistral's window on every layer): a request far longer than the KV cache
    runs, because blocks behind the window are freed as it goes, with HF's tokens; max_model_len is 4x
    the window and 2x the cache."""
    path, hf_model = tiny_model_factory("mistral-window")
    prompt = random_prompts(1, 70, 70, seed=11)[0]
    max_tokens = 120  # 190 tokens = 12 blocks of 16; the cache has 5
    llm = LLM(path, max_model_len=4 * WINDOW * 2, kv_cache_memory_bytes=16 << 20, num_gpu_blocks_override=5,
              max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.group_windows == (WINDOW,)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, [prompt], max_tokens)[0]
    assert engine.get_stats().num_preemptions == 0
    assert engine.kv_cache_manager.pool.num_free_blocks == 5


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_interleaved_model_frees_blocks_behind_the_window(tiny_model_factory, arch):
    """Gemma's windowed and full layers keep their own block tables (KV cache groups): the full group
    holds every block, each windowed group only its window (plus one chunk), so a request of
    max_model_len (6x the window) runs in 18 blocks where keeping every block in every group would take
    30, with HF's tokens and no preemption."""
    path, hf_model = tiny_model_factory(arch)
    prompt = random_prompts(1, 100, 100, seed=13)[0]
    max_tokens = 44  # 144 tokens: 9 blocks of 16
    llm = LLM(path, max_model_len=160, kv_cache_memory_bytes=16 << 20, num_gpu_blocks_override=18,
              max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    assert kv.group_windows == (WINDOW, None, WINDOW)  # one group per layer: windowed, full, windowed
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    peak = [0] * len(kv.groups)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
        for r in engine.scheduler.running:
            for g, group in enumerate(kv.groups):
                peak[g] = max(peak[g], len(group.live_blocks(r.request_id)))
        kv.check_invariants()
    assert outputs[0].outputs[0].token_ids == hf_greedy(hf_model, [prompt], max_tokens)[0]
    assert engine.get_stats().num_preemptions == 0
    for window, held in zip(kv.group_windows, peak):
        # a window of 24 and a chunk of 16 touch at most 3 blocks, plus the one being filled
        assert held == 9 if window is None else 2 <= held <= 4
    assert kv.pool.num_free_blocks == 18


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_interleaved_model_with_preemption_and_prefix_hits(model_factory_prompts, arch, mode):
    """Preempted requests of an interleaved model resume with HF's tokens, recomputed or swapped back
    (only the blocks each group still holds travel to the CPU and back); the same prompts again, the most
    recently finished first, hit the prefix cache in every group (a windowed group needs the blocks inside
    the window of the first computed token, which it freed first, so older requests' hits are evicted)."""
    path, prompts, expected = model_factory_prompts(arch)
    swap = {"preemption_mode": "swap", "swap_space": 0.01} if mode == "swap" else {}
    llm = LLM(path, max_model_len=160, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=20, max_num_seqs=6,
              num_gpu_blocks_override=20, **swap)
    for order in (slice(None), slice(None, None, -1)):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[order]], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected[order]
    engine = llm.llm_engine
    assert engine.get_stats().prefix_cache_hits > 0
    assert engine.scheduler.num_preemptions_by_mode[mode] > 0
    assert engine.kv_cache_manager.pool.num_free_blocks == 20


@pytest.fixture(scope="module")
def model_factory_prompts(tiny_model_factory):
    cache = {}

    def make(arch):
        if arch not in cache:
            path, hf_model = tiny_model_factory(arch)
            prompts = random_prompts(4, WINDOW + 1, 4 * WINDOW, seed=3) + _shared_prefix_prompts(9)
            cache[arch] = path, prompts, hf_greedy(hf_model, prompts, MAX_TOKENS)
        return cache[arch]

    return make


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "olmo2", "cohere", "cohere2"])
def test_tensor_parallel_matches_single_process(tiny_model_factory, arch):
    """TP=2 (gloo, a process per rank): Gemma 2's soft-capped interleaved layers, Phi-3's fused
    projections cut per rank with its window freeing blocks, and OLMo 2's q/k norm over the projection
    split across ranks give the TP=1 and HF tokens."""
    path, hf_model = tiny_model_factory(arch)
    prompts = random_prompts(3, WINDOW + 10, 3 * WINDOW, seed=5)
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    single, _ = _generate(path, prompts)
    llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=16 << 20, tensor_parallel_size=2,
              max_num_batched_tokens=32, max_num_seqs=4)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == single == expected


_TRITON_SCRIPT = r"""
import json, sys
from kvserve import LLM, SamplingParams
path, kwargs, prompts, max_tokens = json.loads(sys.stdin.read())
llm = LLM(path, attention_backend="triton", **kwargs)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
s = llm.llm_engine.get_stats()
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "preemptions": s.num_preemptions,
                  "prefix_hits": s.prefix_cache_hits, "groups": len(llm.llm_engine.kv_cache_manager.groups)}))
"""


def test_triton_backend_with_kv_cache_groups_matches_hf(tiny_model_factory):
    """The Triton attention kernels (under Triton's interpreter on CPU) get each layer's own group's block
    tables and slot mapping: Gemma 3's windowed and full groups, with chunked prefill, a preemption and
    prefix hits (the same prompt again), give HF's tokens."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.triton_interpreter import interpreter_unusable

    pytest.importorskip("triton")
    if (why := interpreter_unusable()) is not None:
        pytest.skip(why)
    path, hf_model = tiny_model_factory("gemma3")
    prompts = random_prompts(2, WINDOW + 20, 3 * WINDOW, seed=21)
    prompts.append(prompts[0])
    engine = dict(max_model_len=96, max_num_batched_tokens=20, max_num_seqs=3, num_gpu_blocks_override=14,
                  kv_cache_memory_bytes=16 << 20)
    payload = json.dumps([path, engine, prompts, 8])
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], input=payload, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).resolve().parents[2],
                          timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run["groups"] == 3 and run["preemptions"] > 0 and run["prefix_hits"] > 0
    assert run["tokens"] == hf_greedy(hf_model, prompts, 8)
