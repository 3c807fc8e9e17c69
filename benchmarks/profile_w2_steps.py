"""Where W2's steps go on the Gemma-3-12B text shape, in kvserve and in vLLM 0.26.0 (dummy weights, the same 64
long requests as benchmarks/gpu_w2_gemma.py and benchmarks/vllm_w2_gemma.py).

When both engines hold the whole batch's KV cache (no preemptions) and kvserve is still behind, the difference is
GPU time per step; this script says in which kernels, in two windows of one W2 run of each engine (its own process:
each takes most of the GPU's memory), with each engine's usual set-up (CUDA graphs; vLLM also torch.compile):
* prefill: after PREFILL_SKIP steps, PREFILL_STEPS steps of full 16,384-token chunks of the long prompts;
* decode: once every request has its first token, WARM_STEPS steps, then DECODE_STEPS decode steps of the batch.
vLLM runs its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the profiler sees its kernels. The
run stops after the decode window (the rest of W2 is not needed).

    # GPU machine, after the vLLM bundle is unpacked (bash .vllm/install.sh):
    OUT=$OUT python3 benchmarks/profile_w2_steps.py --engine vllm
    OUT=$OUT PYTHONPATH=. python3 benchmarks/profile_w2_steps.py --engine kvserve
    python3 benchmarks/profile_w2_steps.py --table $OUT

Each engine's run writes $OUT/w2_steps_<engine>.json (per window: benchmarks/profile_moe_steps.profile_steps'
summary); --table prints each window's kinds of kernel side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, ".vllm")]  # this repository's benchmarks; the bundle's vllm_bench.py

PREFILL_SKIP, PREFILL_STEPS = 2, 4
WARM_STEPS, DECODE_STEPS = 3, 20
WINDOWS = ("prefill", "decode")


def profile_w2(engine, requests: list[tuple[list[int], int]], make_params) -> dict:
    """engine: an LLMEngine of either project; requests: (prompt ids, output tokens); make_params(n): greedy
    sampling of n tokens in the engine's own SamplingParams. Returns {window: profile_steps summary}."""
    from benchmarks.profile_moe_steps import profile_steps

    for i, (ids, n) in enumerate(requests):
        engine.add_request(f"w2-{i}", {"prompt_token_ids": ids}, make_params(n))
    started: set[str] = set()

    def step() -> None:
        started.update(o.request_id for o in engine.step() if o.outputs and len(o.outputs[0].token_ids))

    for _ in range(PREFILL_SKIP):
        step()
    result = {"requests": len(requests), "prefill": profile_steps(engine, PREFILL_STEPS)}
    while len(started) < len(requests) and engine.has_unfinished_requests():
        step()
    for _ in range(WARM_STEPS):
        step()
    result["decode"] = profile_steps(engine, DECODE_STEPS)
    return result


def run_vllm(requests) -> dict:
    import vllm_bench  # the bundle's script: its environment

    from benchmarks.vllm_w2_gemma import MODEL_DIR as model_dir
    from kvserve.bench.datasets import W2_CONFIG, W2_MAX_MODEL_LEN

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, where the profiler is
    vllm_bench._ensure_env()  # re-executes with the bundle on PYTHONPATH the first time
    import vllm
    from vllm import LLM, SamplingParams

    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(W2_CONFIG, f)
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              gpu_memory_utilization=0.90, max_model_len=W2_MAX_MODEL_LEN, seed=0)

    def params(n):
        return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)

    return {"version": vllm.__version__, "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config
            .max_num_batched_tokens, **profile_w2(llm.llm_engine, requests, params)}


def run_kvserve(requests, max_num_batched_tokens: int) -> dict:
    from benchmarks.gpu_w1 import greedy
    from kvserve import LLM
    from kvserve.bench.datasets import W2_MAX_MODEL_LEN, write_w2_config

    llm = LLM(write_w2_config(), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=W2_MAX_MODEL_LEN, max_num_batched_tokens=max_num_batched_tokens)
    result = {"max_num_batched_tokens": max_num_batched_tokens, **profile_w2(llm.llm_engine, requests, greedy)}
    llm.llm_engine.shutdown()
    return result


def print_tables(out_dir: str) -> None:
    from benchmarks.profile_moe_steps import load_runs, print_kinds

    runs = load_runs(out_dir, "w2_steps")
    for window in WINDOWS:
        print_kinds({engine: run[window] for engine, run in runs.items()}, f"GPU ms per W2 {window} step")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["vllm", "kvserve"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384,
                    help="kvserve's step budget (vLLM 0.26.0's default on an H100 or H200, which its run keeps)")
    ap.add_argument("--table", metavar="DIR", help="print the side-by-side tables of the runs' JSON in DIR")
    args = ap.parse_args()
    if args.table:
        return print_tables(args.table)
    if not args.engine:
        ap.error("--engine (or --table DIR)")
    from kvserve.bench.datasets import w2_requests

    requests = [(r.prompt_token_ids, r.expected_output_len) for r in w2_requests()]
    result = run_vllm(requests) if args.engine == "vllm" else run_kvserve(requests, args.max_num_batched_tokens)
    result["engine"] = args.engine
    print(json.dumps({w: {k: v for k, v in result[w].items() if k != "top_kernels"} for w in WINDOWS}), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"w2_steps_{args.engine}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
