"""Where time to first token goes on the GPU: one prompt of 128 (and 2,048) tokens, max_tokens=1, on the
W1 model (Llama-3.1-8B shape, dummy bf16 weights), or with --model gemma3 W2's model (Gemma-3-12B text shape:
windowed and global layers) at W2's step budget. Prints LLM.generate's TTFT (best of 5), the engine step alone,
torch.profiler's GPU busy time against the step's wall time (the gap is host overhead), and the GPU time by
kind of kernel (GEMM, attention, norms, the rest).

    PYTHONUNBUFFERED=1 python benchmarks/profile_prefill.py [--model w1|gemma3] [--tokens 128,2048]
"""

from __future__ import annotations

import argparse
import random
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_w1 import W1_CONFIG, write_config


def prompt(n: int) -> list[int]:
    rng = random.Random(1)
    return [rng.randint(100, 119999) for _ in range(n)]


def ttft(llm, ids, repeats=5) -> float:
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    best = float("inf")
    for _ in range(repeats):
        assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    return best


def profile_step(llm, ids, label):
    from kvserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        engine.add_request(label, {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    cuda = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.self_device_time_total for e in cuda) / 1e6
    launches = sum(e.count for e in cuda)
    print(f"\n== {label}: wall {wall * 1e3:.2f} ms, GPU busy {gpu * 1e3:.2f} ms, {launches} kernels ==")
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    print("GPU ms by kind:", {k: round(v, 2) for k, v in gpu_ms_by_kind(events).items()})
    return wall, gpu, launches


# Kernel names by kind: kvserve's Triton attention (and vLLM's FlashAttention, itself a CUTLASS kernel: so
# attention is matched first), cuBLAS / CUTLASS GEMMs, norms (also torch.compile's fused ones, named after their
# ops), and everything else.
KINDS = (("attention", r"attention|_attn|_decode_kernel|combine_splits|flash_fwd|FlashAttn|fmha"),
         ("gemm", r"gemm|cutlass|nvjet|sm90_xmma|cublas|scaled_mm"),
         ("norm", r"rms|norm|rsqrt"), ("activation", r"silu|gelu|act_and_mul"), ("rotary", r"rotary|rope"),
         ("kv write", r"reshape_and_cache|cache_write"))


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def gpu_ms_by_kind(events) -> dict[str, float]:
    """GPU milliseconds of a profiler's key_averages() by kernel_kind, largest first."""
    kinds: dict[str, float] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(e.key)
            kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / 1e3
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def main():
    from kvserve import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["w1", "gemma3"], default="w1")
    ap.add_argument("--tokens", default="128,2048", help="prompt lengths, comma-separated")
    args = ap.parse_args()
    if args.model == "gemma3":
        from kvserve.bench.datasets import W2_MAX_MODEL_LEN, write_w2_config

        path, max_len = write_w2_config(), W2_MAX_MODEL_LEN
    else:
        path, max_len = write_config(W1_CONFIG), 4096
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=max_len, max_num_seqs=256, max_num_batched_tokens=16384)
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        ids = prompt(n)
        ttft(llm, ids, repeats=2)  # warm-up (JIT)
        best = ttft(llm, ids)
        wall, gpu, launches = profile_step(llm, ids, f"prefill-{n}")
        rows.append((n, best, wall, gpu, launches))
    print("\n| prompt tokens | TTFT best of 5 ms | profiled wall ms | GPU busy ms | kernels |\n|---|---|---|---|---|")
    for n, best, wall, gpu, launches in rows:
        print(f"| {n} | {best * 1e3:.2f} | {wall * 1e3:.2f} | {gpu * 1e3:.2f} | {launches} |")


if __name__ == "__main__":
    main()
