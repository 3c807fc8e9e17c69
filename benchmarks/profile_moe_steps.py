"""Where a Qwen3-30B-A3B decode step of W1's batch goes, in kvserve and in vLLM 0.26.0, on one checkpoint.

W1's fp8 rate on a random fp8 checkpoint is a few percent behind vLLM's while both are bound by the GPU; this
script says which kernels the difference is in. Each engine (its own process: each takes most of the GPU's
memory) gets W1's first N prompts (the bundle's make_workload, 256 by default), greedy, 64 output tokens, with
its usual set-up (CUDA graphs; vLLM also torch.compile); once every request has its first token, three steps
warm up and torch.profiler records 20 decode steps. vLLM runs its engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the profiler sees its kernels.

    # GPU machine, after the vLLM bundle is unpacked (bash .vllm/install.sh), on a checkpoint written by
    # benchmarks/write_random_checkpoint.py (benchmarks/gpu_moe_checkpoint.sh with PROFILE=1 runs all three):
    OUT=$OUT python3 benchmarks/profile_moe_steps.py --engine vllm --checkpoint DIR
    OUT=$OUT PYTHONPATH=. python3 benchmarks/profile_moe_steps.py --engine kvserve --checkpoint DIR
    python3 benchmarks/profile_moe_steps.py --table $OUT

Each engine's run writes $OUT/moe_steps_<engine>.json: wall and GPU-busy milliseconds per step, GPU milliseconds
per step by kind of kernel (kind_of below) and the top kernels with their launches per step; --table prints
the kinds side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, ".vllm")]  # this repository's benchmarks; the bundle's vllm_bench.py
OUTPUT_TOKENS = 64
WARM_STEPS, PROFILED_STEPS = 3, 20

# Kernel names by kind, the MoE pieces first (both engines' names: vLLM's fused_moe_kernel, moe_align_block_size,
# topk_softmax and moe_sum; kvserve's moe_grouped_gemm, pair sorts and router), then profile_prefill's kinds, and
# last the activations' quantization kernels that none of those named.
MOE_KINDS = (("moe gemm", r"fused_moe_kernel|moe_grouped_gemm"),
             ("moe sort", r"moe_align|align_one_program|count_pairs|place_pairs|sort"),
             ("router", r"topk|router|gating|softmax"),
             ("moe sum", r"moe_sum|sum_pairs"))


def kind_of(name: str) -> str:
    from benchmarks.profile_prefill import kernel_kind

    kind = next((kind for kind, pattern in MOE_KINDS if re.search(pattern, name, re.IGNORECASE)), None)
    kind = kind or kernel_kind(name)
    return "activation quant" if kind == "other" and re.search(r"quant|fp8", name, re.IGNORECASE) else kind


def profile_decode(engine, prompts, params) -> dict:
    """engine: an LLMEngine of either project (add_request, step, has_unfinished_requests)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": p}, params)
    started: set[str] = set()
    while len(started) < len(prompts) and engine.has_unfinished_requests():
        started |= {o.request_id for o in engine.step() if o.outputs and len(o.outputs[0].token_ids)}
    for _ in range(WARM_STEPS):
        engine.step()
    result = profile_steps(engine, PROFILED_STEPS)
    while engine.has_unfinished_requests():
        engine.step()
    return {"requests": len(prompts), **result}


def profile_steps(engine, num_steps: int) -> dict:
    """The engine's next num_steps steps under torch.profiler: wall and GPU-busy milliseconds per step, GPU
    milliseconds per step by kind of kernel (kind_of) and the top kernels with their launches per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # CPU: a smoke run of the flow
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        sync()
        wall = (time.perf_counter() - t) / num_steps
    cuda = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind: dict[str, float] = {}
    for e in cuda:
        kind = kind_of(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e3 / num_steps
    top = sorted(cuda, key=lambda e: -e.self_device_time_total)[:25]
    return {"profiled_steps": num_steps, "wall_ms_per_step": round(wall * 1e3, 3),
            "gpu_ms_per_step": round(sum(by_kind.values()), 3),
            "gpu_ms_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": e.key[:120], "ms_per_step": round(e.self_device_time_total / 1e3 / num_steps, 3),
                             "launches_per_step": round(e.count / num_steps, 1)} for e in top]}


def run_vllm(args, prompts) -> dict:
    import vllm_bench  # the bundle's script: its environment

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, where the profiler is
    vllm_bench._ensure_env()  # re-executes with the bundle on PYTHONPATH the first time
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.checkpoint, load_format="auto", skip_tokenizer_init=True, dtype="bfloat16",
              gpu_memory_utilization=0.90, max_model_len=4096, seed=0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=OUTPUT_TOKENS, detokenize=False)
    return {"version": vllm.__version__, **profile_decode(llm.llm_engine, prompts, params)}


def run_kvserve(args, prompts) -> dict:
    from benchmarks.gpu_w1 import greedy
    from kvserve import LLM

    llm = LLM(args.checkpoint, load_format="auto", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=16384)
    result = profile_decode(llm.llm_engine, prompts, greedy(OUTPUT_TOKENS))
    llm.llm_engine.shutdown()
    return result


def print_table(out_dir: str) -> None:
    print_kinds(load_runs(out_dir, "moe_steps"), "GPU ms per decode step")


def load_runs(out_dir: str, prefix: str) -> dict[str, dict]:
    """{engine: its run's JSON} of the runs written to out_dir as <prefix>_<engine>.json, kvserve first."""
    runs = {}
    for engine in ("kvserve", "vllm"):
        path = os.path.join(out_dir, f"{prefix}_{engine}.json")
        if os.path.exists(path):
            with open(path) as f:
                runs[engine] = json.load(f)
    return runs


def print_kinds(runs: dict[str, dict], title: str) -> None:
    """Each run's top kernels, then their GPU milliseconds by kind side by side (kvserve - vLLM with both)."""
    for engine, r in runs.items():
        print(f"\n{engine}: top kernels, GPU ms per step (launches per step)")
        for k in r["top_kernels"][:12]:
            print(f"  {k['ms_per_step']:8.3f}  ({k['launches_per_step']:6.1f})  {k['name'][:90]}")
    kinds = sorted({k for r in runs.values() for k in r["gpu_ms_by_kind"]},
                   key=lambda k: -max(r["gpu_ms_by_kind"].get(k, 0.0) for r in runs.values()))
    names = list(runs)
    print(f"\n| {title} | " + " | ".join(names) + (" | kvserve - vLLM |" if len(runs) == 2 else " |"))
    print("|---" * (len(names) + 1 + (len(runs) == 2)) + "|")
    rows = [(k, [runs[n]["gpu_ms_by_kind"].get(k, 0.0) for n in names]) for k in kinds]
    rows += [("all kernels (GPU busy)", [runs[n]["gpu_ms_per_step"] for n in names]),
             ("wall per step", [runs[n]["wall_ms_per_step"] for n in names])]
    for label, values in rows:
        diff = f" | {values[0] - values[1]:+.3f}" if len(values) == 2 else ""
        print(f"| {label} | " + " | ".join(f"{v:.3f}" for v in values) + diff + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["vllm", "kvserve"])
    ap.add_argument("--checkpoint", help="an HF directory (benchmarks/write_random_checkpoint.py --shape "
                                         "qwen3-30b-a3b [--fp8]); its quantization_config decides the format")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--table", metavar="DIR", help="print the side-by-side table of the runs' JSON in DIR")
    args = ap.parse_args()
    if args.table:
        return print_table(args.table)
    if not (args.engine and args.checkpoint):
        ap.error("--engine and --checkpoint (or --table DIR)")
    import vllm_bench  # importing it needs no vllm

    prompts = [ids for ids, _ in vllm_bench.make_workload(args.num_requests)]
    result = (run_vllm if args.engine == "vllm" else run_kvserve)(args, prompts)
    result.update(engine=args.engine, checkpoint=args.checkpoint)
    print(json.dumps({k: v for k, v in result.items() if k != "top_kernels"}), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"moe_steps_{args.engine}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
