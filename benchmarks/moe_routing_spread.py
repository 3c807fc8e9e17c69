"""How many distinct experts a decode step routes to, in vLLM 0.26.0 and in kvserve, on the dummy-weight
Qwen3-30B-A3B shape of the MoE comparison (benchmarks/gpu_moe.py), bf16 and fp8.

A routed-experts call reads the weights of every expert it routes to, so its cost follows the number of
distinct experts per step, and with dummy weights that number depends on the weights' values: an engine whose
dummy model sends every request to the same few experts runs a cheaper workload than one whose requests spread
over all 128. This script measures the spread on both engines, for the same requests (W1's first N prompts,
greedy, 32 output tokens each, all running at once):

    # GPU machine, after the vLLM bundle is unpacked (bash .vllm/install.sh)
    OUT=$OUT python3 benchmarks/moe_routing_spread.py --engine vllm [--quantization fp8]
    OUT=$OUT PYTHONPATH=. python3 benchmarks/moe_routing_spread.py --engine kvserve [--quantization fp8]
    # both on the same weights: --checkpoint DIR (benchmarks/write_random_checkpoint.py), e.g. an fp8 one

vLLM: `enable_return_routed_experts=True` returns each request's experts per position and layer; the decode
step of output position j is approximated by the requests' j-th output positions together. kvserve: the
router's choices recorded per decode step (eager mode, every running request in the step). Both report, over
the decode steps and layers, the mean / min / max number of distinct experts (of 128) and the share of output
positions at which every request produced the same token. JSON goes to $OUT/moe_routing_<engine>_<q>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT_TOKENS = 32


def summary(distinct: list[int], outputs: list[list[int]], experts: int) -> dict:
    positions = min(len(o) for o in outputs)
    same = sum(len({o[j] for o in outputs}) == 1 for j in range(positions))
    return {"layer_steps": len(distinct), "experts": experts,
            "distinct_experts_mean": round(sum(distinct) / max(len(distinct), 1), 2),
            "distinct_experts_min": min(distinct, default=0), "distinct_experts_max": max(distinct, default=0),
            "positions_with_one_token_for_all": f"{same}/{positions}"}


def run_vllm(args, prompts) -> dict:
    import vllm_bench  # the bundle's script (main put .vllm/ on the path): its shapes, model folder, environment

    vllm_bench._ensure_env()  # re-executes with the bundle on PYTHONPATH the first time
    os.makedirs(vllm_bench.MODEL_DIR, exist_ok=True)
    config = vllm_bench.SHAPES["qwen3-30b-a3b"]
    with open(os.path.join(vllm_bench.MODEL_DIR, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    import numpy as np
    from vllm import LLM, SamplingParams

    kw = dict(model=args.checkpoint or vllm_bench.MODEL_DIR, load_format="auto" if args.checkpoint else "dummy",
              skip_tokenizer_init=True, dtype="bfloat16",
              gpu_memory_utilization=0.90, max_model_len=4096, seed=0, enforce_eager=True,
              enable_return_routed_experts=True)
    if args.quantization:
        kw["quantization"] = args.quantization
    llm = LLM(**kw)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=OUTPUT_TOKENS, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    routed = [np.asarray(o.outputs[0].routed_experts) for o in outs]  # [positions, layers, top_k] each
    distinct = []
    for j in range(OUTPUT_TOKENS - 1):  # the j-th output token is the input of decode step j + 1
        rows = [r[len(p) + j] for r, p in zip(routed, prompts) if len(p) + j < len(r)]
        if len(rows) == len(prompts):
            step = np.stack(rows)  # [requests, layers, top_k]
            distinct += [int(np.unique(step[:, layer]).size) for layer in range(step.shape[1])]
    return summary(distinct, [list(o.outputs[0].token_ids) for o in outs], config["num_experts"])


def run_kvserve(args, prompts) -> dict:
    sys.path[:0] = [REPO]
    import torch

    import kvserve.model.moe as moe
    from benchmarks.gpu_moe import QWEN3_30B_A3B
    from benchmarks.gpu_w1 import greedy, write_config
    from kvserve import LLM

    distinct, decode_rows = [], len(prompts)
    choose = moe.select_experts

    def recording(logits, *a, **kw):
        weights, ids = choose(logits, *a, **kw)
        if logits.shape[0] == decode_rows:  # a decode step of every request (eager: no graphs)
            distinct.append(int(torch.unique(ids).numel()))
        return weights, ids

    moe.select_experts = recording
    llm = LLM(args.checkpoint or write_config(QWEN3_30B_A3B), load_format="auto" if args.checkpoint else "dummy",
              skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=4096, enforce_eager=True, quantization=args.quantization)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(OUTPUT_TOKENS), use_tqdm=False)
    llm.llm_engine.shutdown()
    return summary(distinct, [list(o.outputs[0].token_ids) for o in outs], QWEN3_30B_A3B["num_experts"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["vllm", "kvserve"], required=True)
    ap.add_argument("--quantization", default=None, help="fp8, or none for bf16")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--checkpoint", help="read this HF directory (benchmarks/write_random_checkpoint.py) instead "
                                         "of dummy weights; its quantization_config decides the format")
    args = ap.parse_args()
    sys.path[:0] = [os.path.join(REPO, ".vllm")]
    import vllm_bench  # importing it needs no vllm

    prompts = [ids for ids, _ in vllm_bench.make_workload(args.num_requests)]
    result = (run_vllm if args.engine == "vllm" else run_kvserve)(args, prompts)
    result.update(engine=args.engine, quantization=args.quantization or "bf16", requests=len(prompts),
                  output_tokens=OUTPUT_TOKENS)
    print(json.dumps(result), flush=True)
    if os.environ.get("OUT"):
        name = f"moe_routing_{args.engine}_{'checkpoint' if args.checkpoint else result['quantization']}.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
