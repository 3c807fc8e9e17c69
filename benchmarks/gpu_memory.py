"""Memory on one GPU: `kvserve plan` vs the engine's own start-up numbers, and preemption modes on W1.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/gpu_memory.py --out $OUT [--num-requests N]

1. correctness: a small random bf16 Llama under heavy preemption (few KV blocks): --preemption-mode swap and
   auto give exactly the greedy tokens of recompute (and swap really swapped).
2. plan vs engine: the W1 model (Llama-3.1-8B shape, dummy bf16 weights, max_model_len 4096) at
   --gpu-memory-utilization 0.5 and 0.9 (and with --kv-cache-dtype fp8 where the engine has it): the plan's
   weights and KV tokens against what the engine measured and allocated (goal: within 5%). The plan is
   given the GPU size and the memory others held, as the engine measured them; the plan for `--gpu H200`
   with its default 0.5 GiB for others is printed too.
3. W1 with --num-gpu-blocks-override 4096 (65,536 KV tokens for 256 requests of up to 2,048): recompute vs
   swap vs auto (--swap-space 8) output throughput in the same run, with preemption counts by mode.
A table is printed last; everything also goes to OUT/gpu_memory.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import tempfile
import time

import torch

GiB = 1 << 30


def _w1_dir() -> str:
    from kvserve.bench.datasets import write_w1_config

    path = tempfile.mkdtemp(prefix="kvserve-w1-")
    write_w1_config(path)
    return path


def _w1_requests(n: int):
    rng = random.Random(0)
    reqs = []
    for _ in range(256):
        in_len, out_len = rng.randint(100, 1024), rng.randint(100, 1024)
        reqs.append(([rng.randint(100, 119999) for _ in range(in_len)], out_len))
    assert sum(len(p) for p, _ in reqs) == 144581 and sum(o for _, o in reqs) == 151597
    return reqs[:n]


def _release() -> None:
    """After the caller dropped its engine: give its memory back before the next engine measures the GPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _greedy(max_tokens: int):
    from kvserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


# ---- 1. correctness -----------------------------------------------------------------------------------
def correctness(results: dict, device: str) -> bool:
    import transformers

    from kvserve import LLM

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="kvserve-small-")
    # fp32 on the GPU too: in bf16 any change of batch shape (which preemption is) can flip a near-tied
    # argmax, so only fp32 makes "same tokens" a test of the K/V that swap restores.
    dtype = "float32"
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype)).save_pretrained(path)
    rng = random.Random(3)
    # On CPU (a smoke run of this script) a smaller load that still preempts.
    n, max_tokens, longest, blocks = (24, 64, 200, 40) if device == "cuda" else (6, 24, 100, 12)
    prompts = [{"prompt_token_ids": [rng.randrange(32000) for _ in range(rng.randint(40, longest))]}
               for _ in range(n)]
    tokens, counts = {}, {}
    for mode, swap in (("no preemption", 0), ("recompute", 0), ("swap", 1), ("auto", 1)):
        llm = LLM(path, skip_tokenizer_init=True, dtype=dtype, device=device, max_model_len=min(512, blocks * 16),
                  num_gpu_blocks_override=blocks * 50 if mode == "no preemption" else blocks,
                  preemption_mode="recompute" if mode == "no preemption" else mode, swap_space=swap,
                  enable_prefix_caching=False)
        outs = llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)
        tokens[mode] = [o.outputs[0].token_ids for o in outs]
        counts[mode] = llm.llm_engine.get_stats().num_preemptions_by_mode
        del llm, outs
        _release()
    reference = tokens["no preemption"]
    same = {mode: sum(a == b for a, b in zip(tokens[mode], reference)) for mode in ("recompute", "swap", "auto")}
    ok = all(n == len(reference) for n in same.values())
    swapped = counts["swap"].get("swap", 0) > 0
    results["correctness"] = {"dtype": dtype, "identical": ok, "sequences_identical_to_no_preemption": same,
                              "of": len(reference), "preemptions": counts}
    print(f"correctness ({dtype}): sequences identical to a run without preemption {same} of {len(reference)}; "
          f"preemptions {counts}", flush=True)
    if not swapped:
        print("correctness: WARNING swap mode never swapped", flush=True)
    return ok and swapped


# ---- 2. plan vs engine ----------------------------------------------------------------------------------
def plan_vs_engine(results: dict, w1: str) -> list[dict]:
    from kvserve import LLM
    from kvserve.config import EngineArgs
    from kvserve.entrypoints import plan as plan_cli
    from kvserve.entrypoints.cli import build_parser
    from kvserve.sizing import memory_plan

    rows = []
    kv_dtypes = ["auto"]
    try:
        EngineArgs(kv_cache_dtype="fp8")
        kv_dtypes.append("fp8")
    except ValueError:
        print("plan vs engine: --kv-cache-dtype fp8 not in this engine; skipped", flush=True)
    for kv_dtype in kv_dtypes:
        for util in (0.5, 0.9):
            flags = dict(max_model_len=4096, gpu_memory_utilization=util)
            if kv_dtype != "auto":
                flags["kv_cache_dtype"] = kv_dtype
            t0 = time.perf_counter()
            llm = LLM(w1, load_format="dummy", skip_tokenizer_init=True, **flags)
            engine = llm.llm_engine
            start = engine.executor.worker.startup  # the in-process (uni) worker measured the start-up
            measured = {"weights": start.weights, "activation_peak": start.activation_peak,
                        "kv_tokens": engine.num_kv_blocks * 16, "others": start.others, "total": start.total}
            del llm, engine, start
            _release()
            argv = ["plan", w1, "--load-format", "dummy", "--max-model-len", "4096",
                    "--gpu-memory-utilization", str(util)]
            if kv_dtype != "auto":
                argv += ["--kv-cache-dtype", kv_dtype]
            ns = build_parser().parse_args(argv + ["--gpu-memory-gib", str(measured["total"] / GiB),
                                                   "--others-gib", str(measured["others"] / GiB)])
            plan = memory_plan.make_plan(plan_cli.plan_inputs_from_namespace(ns))
            default = memory_plan.make_plan(plan_cli.plan_inputs_from_namespace(
                build_parser().parse_args(argv + ["--gpu", "H200"])))
            row = {
                "kv_cache_dtype": kv_dtype, "utilization": util, **{f"engine_{k}": v for k, v in measured.items()},
                "plan_weights": plan.ranks[0].weights, "plan_activation_peak": plan.ranks[0].activation_peak,
                "plan_kv_tokens": plan.kv_tokens, "plan_h200_default_kv_tokens": default.kv_tokens,
                "weights_ratio": plan.ranks[0].weights / measured["weights"],
                "kv_tokens_ratio": plan.kv_tokens / measured["kv_tokens"],
                "seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            print(f"plan vs engine kv={kv_dtype} util={util}: weights {row['plan_weights'] / GiB:.3f} vs "
                  f"{measured['weights'] / GiB:.3f} GiB ({row['weights_ratio']:.4f}); activation "
                  f"{row['plan_activation_peak'] / GiB:.3f} vs {measured['activation_peak'] / GiB:.3f} GiB; KV tokens "
                  f"{plan.kv_tokens} vs {measured['kv_tokens']} ({row['kv_tokens_ratio']:.4f}); `--gpu H200` plan "
                  f"{default.kv_tokens}; others {measured['others'] / GiB:.2f} GiB", flush=True)
    results["plan_vs_engine"] = rows
    return rows


# ---- 3. preemption modes on W1 ----------------------------------------------------------------------------
def preemption_modes(results: dict, w1: str, n: int) -> list[dict]:
    from kvserve import LLM, SamplingParams

    reqs = _w1_requests(n)
    rows, outputs = [], {}
    for mode, swap in (("recompute", 0), ("swap", 8), ("auto", 8)):
        llm = LLM(w1, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
                  num_gpu_blocks_override=4096, preemption_mode=mode, swap_space=swap)
        warm = [{"prompt_token_ids": [100 + i] * 16} for i in range(2)]
        llm.generate(warm, _greedy(4), use_tqdm=False)
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True, detokenize=False) for _, o in reqs]
        before = dict(llm.llm_engine.get_stats().num_preemptions_by_mode)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = llm.llm_engine.get_stats().num_preemptions_by_mode
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        outputs[mode] = [o.outputs[0].token_ids for o in outs]
        row = {"mode": mode, "swap_space_gib": swap, "elapsed": elapsed, "output_tokens": out_tokens,
               "output_tok_s": out_tokens / elapsed,
               "preemptions": {k: after[k] - before.get(k, 0) for k in after}}
        rows.append(row)
        print(f"W1 blocks=4096 {mode}: {row['output_tok_s']:,.0f} output tok/s in {elapsed:.1f} s, preemptions "
              f"{row['preemptions']}", flush=True)
        del llm, outs
        _release()
    for row in rows:
        row["identical_to_recompute"] = sum(a == b for a, b in zip(outputs[row["mode"]], outputs["recompute"]))
    results["preemption_modes"] = rows
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--skip-preemption", action="store_true")
    ns = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvserve.worker.memory").setLevel(logging.INFO)
    logging.getLogger("kvserve.engine.llm_engine").setLevel(logging.INFO)
    os.makedirs(ns.out, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    results = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "torch": torch.__version__}
    t_start = time.perf_counter()
    ok = correctness(results, "cuda" if on_gpu else "cpu")
    if not on_gpu:  # what runs without a GPU: the correctness check
        print(f"correctness (swap/auto == recompute tokens): {'PASS' if ok else 'FAIL'}; no GPU, nothing else to do")
        return 0 if ok else 1
    w1 = _w1_dir()
    plans = plan_vs_engine(results, w1)
    modes = [] if ns.skip_preemption else preemption_modes(results, w1, ns.num_requests)
    results["seconds"] = time.perf_counter() - t_start
    with open(os.path.join(ns.out, "gpu_memory.json"), "w") as f:
        json.dump(results, f, indent=2)

    print(f"\n== gpu_memory on {results['device']} ({results['seconds']:.0f} s) ==")
    print(f"correctness (swap/auto == recompute tokens): {'PASS' if ok else 'FAIL'}")
    print(f"{'kv dtype':<9}{'util':>5}{'weights plan/engine GiB':>26}{'ratio':>8}"
          f"{'KV tokens plan/engine':>24}{'ratio':>8}")
    for r in plans:
        within = "ok" if abs(r["weights_ratio"] - 1) <= 0.05 and abs(r["kv_tokens_ratio"] - 1) <= 0.05 else "OFF"
        print(f"{r['kv_cache_dtype']:<9}{r['utilization']:>5}"
              f"{r['plan_weights'] / GiB:>13.2f}/{r['engine_weights'] / GiB:<12.2f}{r['weights_ratio']:>8.4f}"
              f"{r['plan_kv_tokens']:>12}/{r['engine_kv_tokens']:<11}{r['kv_tokens_ratio']:>8.4f} {within}")
    if modes:
        print(f"{'mode':<10}{'out tok/s':>11}{'vs recompute':>14}{'preemptions':>28}{'same tokens':>13}")
        base, n = modes[0]["output_tok_s"], min(ns.num_requests, 256)
        for r in modes:
            print(f"{r['mode']:<10}{r['output_tok_s']:>11,.0f}{r['output_tok_s'] / base:>14.3f}"
                  f"{json.dumps(r['preemptions']):>28}{r['identical_to_recompute']:>8}/{n}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
