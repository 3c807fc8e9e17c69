"""Where a decode step's time goes on the GPU: torch.profiler over batch-1 and batch-256 decode steps
of the W1 model (Llama-3.1-8B shape, dummy bf16 weights). Prints the top kernels and, per step, GPU
busy time against wall time (the gap is host overhead and launch latency).

    PYTHONUNBUFFERED=1 python benchmarks/profile_steps.py [--model moe] [--quantization fp8]

`--model moe` profiles the Qwen3-30B-A3B-shaped model of benchmarks/gpu_moe.py instead; `--model gemma3` W2's
Gemma-3-12B-shaped model decoding W2's 64 long prompts at once (6,000-15,000 tokens of context each), with the
GPU time by kind of kernel.
"""

from __future__ import annotations

import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_w1 import W1_CONFIG, write_config
from benchmarks.profile_prefill import gpu_ms_by_kind


def run(llm, prompts, max_tokens, label):
    from kvserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"{label}-{i}", {"prompt_token_ids": p}, params)
    sched = engine.scheduler
    while not sched.running or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
        engine.step()  # prefill out of the way
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    steps = 20
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.key_averages()
    gpu_total = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / steps
    print(f"\n== {label}: wall {wall * 1e3:.2f} ms/step, GPU busy {gpu_total / 1e3:.2f} ms/step ==")
    print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
    print("GPU ms per step by kind:", {k: round(v / steps, 3) for k, v in gpu_ms_by_kind(events).items()})
    return wall, gpu_total / 1e6


def main():
    import argparse

    from kvserve import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["w1", "moe", "gemma3"], default="w1")
    ap.add_argument("--quantization", default=None)
    args = ap.parse_args()
    if args.model == "gemma3":
        return profile_w2_decode(args.quantization)
    if args.model == "moe":
        from benchmarks.gpu_moe import QWEN3_30B_A3B as config
    else:
        config = W1_CONFIG
    llm = LLM(write_config(config), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384, quantization=args.quantization)
    rng = random.Random(1)
    b1 = run(llm, [[rng.randint(100, 119999) for _ in range(128)]], 64, "batch1")
    prompts = [[rng.randint(100, 119999) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    b256 = run(llm, prompts, 40, "batch256")
    print("\n| step | wall ms | GPU busy ms | host/idle share |\n|---|---|---|---|")
    for name, (wall, gpu) in (("batch-1 decode", b1), ("batch-256 decode", b256)):
        print(f"| {name} | {wall * 1e3:.2f} | {gpu * 1e3:.2f} | {max(0.0, 1 - gpu / wall):.0%} |")


def profile_w2_decode(quantization):
    from kvserve import LLM
    from kvserve.bench.datasets import W2_MAX_MODEL_LEN, w2_requests, write_w2_config

    llm = LLM(write_w2_config(), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=W2_MAX_MODEL_LEN, max_num_seqs=256, max_num_batched_tokens=16384,
              quantization=quantization)
    # W2's prefill takes ~44 steps at this budget, in which the first requests already decode: 80 tokens keep all
    # 64 running through the profiled steps.
    wall, gpu = run(llm, [r.prompt for r in w2_requests()], 80, "w2-decode-64")
    print("\n| step | wall ms | GPU busy ms | host/idle share |\n|---|---|---|---|")
    print(f"| W2 decode, 64 requests | {wall * 1e3:.2f} | {gpu * 1e3:.2f} | {max(0.0, 1 - gpu / wall):.0%} |")


if __name__ == "__main__":
    main()
