"""Where time to first token goes on the GPU: one prompt of 128 (and 2,048) tokens, max_tokens=1, on the
W1 model (Llama-3.1-8B shape, dummy bf16 weights). Prints LLM.generate's TTFT (best of 5), the engine
step alone, and torch.profiler's GPU busy time against the step's wall time (the gap is host overhead).

    PYTHONUNBUFFERED=1 python benchmarks/profile_prefill.py
"""

from __future__ import annotations

import random
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
    return wall, gpu, launches


def main():
    from kvserve import LLM

    llm = LLM(write_config(W1_CONFIG), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)
    rows = []
    for n in (128, 2048):
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
