"""W2 on the GPU: a Gemma-3-12B-shaped text model (dummy bf16 weights, 40 layers with a 1024-token window,
8 full layers) on 64 long prompts (6,000-15,000 tokens, 128-512 outputs; kvserve/bench/datasets.py).

    PYTHONUNBUFFERED=1 python benchmarks/gpu_w2_gemma.py [--out DIR] [--quick] [--passes N] [--vllm-json FILE]

with `--vllm-json` the result of benchmarks/vllm_w2_gemma.py (vLLM 0.26.0, same model and requests) from an
earlier command on the same machine, for the kvserve / vLLM ratio.

1. kernels: the windowed / soft-capped Triton attention against the dense definition and the torch
   backend (pytest tests/kernels/test_triton_attention_window.py, which runs compiled on CUDA, `gpu` tests
   included), and the KV cache groups end to end (tests/engine/test_gpu_hybrid_kv.py: a Gemma-3-shaped
   model vs HF, CUDA graphs == eager, preemption by swap and recompute == none).
2. parity: a tiny random Gemma 2 and Gemma 3 (windows shorter than the prompts), fp32 on the GPU:
   the triton backend gives the torch backend's greedy tokens.
3. W2: seconds, output tok/s and total tok/s, where the host spends a step, the KV cache size and preemptions.
A table is printed last; results go to DIR/gpu_w2_gemma.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch


def kernel_tests() -> str:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/kernels/test_triton_attention_window.py", "tests/engine/test_gpu_hybrid_kv.py"],
                          capture_output=True, text=True, check=False)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    print("\n".join(lines[-15:]))
    return lines[-1] if lines else f"rc {proc.returncode}"


def tiny_parity() -> dict:
    import transformers

    from kvserve import LLM, SamplingParams

    configs = {
        "gemma2": transformers.Gemma2Config(
            vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=64, query_pre_attn_scalar=32,
            attn_logit_softcapping=5.0, final_logit_softcapping=10.0, max_position_embeddings=1024),
        "gemma3": transformers.Gemma3TextConfig(
            vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=64, query_pre_attn_scalar=32,
            sliding_window_pattern=2, max_position_embeddings=1024),
    }
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 4096) for _ in range(rng.randint(100, 400))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        path = tempfile.mkdtemp(prefix=f"kvserve-{name}-")
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
        tokens = {}
        for backend in ("triton", "torch"):
            llm = LLM(path, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, attention_backend=backend,
                      gpu_memory_utilization=0.2, max_num_batched_tokens=128, max_num_seqs=16)
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens[backend] = [r.outputs[0].token_ids for r in res]
            llm.llm_engine.shutdown()
            del llm
            gc.collect()  # the engine's memory goes back before the next one sizes its KV cache
            torch.cuda.empty_cache()
        same = sum(a == b for a, b in zip(tokens["triton"], tokens["torch"]))
        out[name] = f"{same}/{len(prompts)}"
        print(f"parity {name}: triton == torch backend greedy on {out[name]} prompts")
    return out


def run_w2(quick: bool, max_num_batched_tokens: int, passes: int = 1, gpu_memory_utilization: float = 0.9,
           block_size: int | None = None) -> dict:
    """W2 timed `passes` times on one engine (each from an empty prefix cache); the best pass is the row.
    block_size: the KV cache's (the engine's default when None)."""
    from benchmarks.gpu_w1 import StepTimer
    from kvserve import LLM, SamplingParams
    from kvserve.bench.datasets import W2_MAX_MODEL_LEN, w2_requests, write_w2_config
    from kvserve.sizing import memory_plan

    reqs = w2_requests(16 if quick else None)
    path = write_w2_config()
    t0 = time.perf_counter()
    extra = {"block_size": block_size} if block_size else {}
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=W2_MAX_MODEL_LEN,
              max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=gpu_memory_utilization, **extra)
    init_s = time.perf_counter() - t0
    engine = llm.llm_engine
    prompts = [r.engine_prompt() for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.expected_output_len, ignore_eos=True) for r in reqs]
    llm.generate(prompts[:2], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)
    timings = []
    for _ in range(passes):
        assert engine.kv_cache_manager.reset_prefix_cache()
        timer = StepTimer(engine)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        timings.append((time.perf_counter() - t0, timer))
        timer.restore()
    seconds, timer = min(timings, key=lambda pass_: pass_[0])
    steps = max(timer.steps, 1)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(r.prompt_len for r in reqs)
    assert n_out == sum(r.expected_output_len for r in reqs)
    stats = engine.get_stats()
    startup = engine.executor.worker.startup  # what the GPU sizing measured (kvserve/worker/memory.py)
    sizing = {"weights": startup.weights, "activation_peak": startup.activation_peak, "non_torch": startup.non_torch,
              "graph_reserve": startup.graph_reserve, "kv_cache": engine.executor.worker.kv_bytes}
    return {
        "memory_gib": {k: round(v / 2**30, 2) for k, v in sizing.items() if v is not None},
        "requests": len(reqs), "prompt_tokens": n_in, "output_tokens": n_out, "seconds": round(seconds, 2),
        "output_tok_s": round(n_out / seconds, 1), "total_tok_s": round((n_in + n_out) / seconds, 1),
        "kv_cache_groups": len(engine.kv_cache_manager.groups),
        "kv_blocks": engine.num_kv_blocks, "block_size": engine.config.args.block_size,
        "kv_cache_tokens": memory_plan.kv_cache_tokens(engine.num_kv_blocks, engine.config.args.block_size,
                                                       engine.kv_cache_manager.group_windows, max_num_batched_tokens),
        "preemptions": stats.num_preemptions, "init_s": round(init_s, 1),
        "max_num_batched_tokens": max_num_batched_tokens, "passes_s": [round(t, 2) for t, _ in timings],
        # Where the host spends a step (benchmarks/gpu_w1.py's StepTimer): waiting on the GPU is time it is idle.
        "steps": timer.steps, "ms_per_step": round(1000 * seconds / steps, 2),
        "schedule_ms_per_step": round(1000 * timer.sched / steps, 3),
        "launch_ms_per_step": round(1000 * timer.launch / steps, 3),
        "gpu_wait_ms_per_step": round(1000 * timer.wait / steps, 3),
        "update_ms_per_step": round(1000 * timer.update / steps, 3),
    }


def apply_attention_overrides(path: str) -> dict:
    """Sets the file's TritonAttentionBackend attributes (or those of `path` itself when it is a JSON object) on the
    class (the engine builds its own instance)."""
    from kvserve.ops.triton_attention import TritonAttentionBackend

    if path.lstrip().startswith("{"):
        attrs = json.loads(path)
    else:
        with open(path) as f:
            attrs = json.load(f)
    attrs = attrs.get("best", attrs)
    for name, value in attrs.items():
        if not hasattr(TritonAttentionBackend, name):
            raise ValueError(f"TritonAttentionBackend has no attribute {name!r}")
        setattr(TritonAttentionBackend, name, tuple(value) if isinstance(value, list) else value)
    return attrs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="W2's first 16 requests only")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384,
                    help="the step budget (vLLM 0.26.0's default on an H200, so both engines get the same)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="another KV cache size (vLLM's run keeps its default 0.9): how much preemptions cost")
    ap.add_argument("--vllm-json", help="vLLM's result on the same run (benchmarks/vllm_w2_gemma.py): adds ratios")
    ap.add_argument("--attention-overrides", help="a JSON object of TritonAttentionBackend attributes for this run, "
                    "or a file of one (or of benchmarks/sweep_decode_attention.py --gemma's result, whose fastest "
                    "variant it takes)")
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    ap.add_argument("--passes", type=int, default=1, help="timed W2 passes (the best is the row)")
    ap.add_argument("--block-size", type=int, default=None, help="the KV cache's block size (the engine's default)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    results = {"device": torch.cuda.get_device_name()}
    if args.attention_overrides:
        results["attention_overrides"] = apply_attention_overrides(args.attention_overrides)
    if not args.skip_checks:
        results["kernel_tests"] = kernel_tests()
        results["parity"] = tiny_parity()
    results["w2"] = run_w2(args.quick, args.max_num_batched_tokens, args.passes,
                          args.gpu_memory_utilization, args.block_size)
    if args.vllm_json and os.path.exists(args.vllm_json):
        with open(args.vllm_json) as f:
            results["vllm"] = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gpu_w2_gemma{args.tag}.json"), "w") as f:
        json.dump(results, f, indent=2)
    w2 = results["w2"]
    print(f"\n| W2 Gemma-3-12B shape, {results['device']} | value |\n|---|---|")
    if "kernel_tests" in results:
        print(f"| windowed/soft-capped Triton attention vs reference | {results['kernel_tests']} |")
        for name, same in results["parity"].items():
            print(f"| {name} tiny fp32: triton == torch backend greedy | {same} |")
    print(f"| requests / prompt / output tokens | {w2['requests']} / {w2['prompt_tokens']:,} / {w2['output_tokens']:,} |")
    print(f"| seconds (every pass) | {w2['seconds']} ({w2['passes_s']}) |")
    print(f"| steps; ms a step: schedule / launch / GPU wait / update | {w2['steps']}; {w2['ms_per_step']}: "
          f"{w2['schedule_ms_per_step']} / {w2['launch_ms_per_step']} / {w2['gpu_wait_ms_per_step']} / "
          f"{w2['update_ms_per_step']} |")
    print(f"| output tok/s | {w2['output_tok_s']:,} |")
    print(f"| total (prompt + output) tok/s | {w2['total_tok_s']:,} |")
    print(f"| KV cache groups / blocks of {w2['block_size']} / longest request (tokens) | {w2['kv_cache_groups']} / "
          f"{w2['kv_blocks']:,} / {w2['kv_cache_tokens']:,} |")
    print(f"| preemptions | {w2['preemptions']} |")
    print(f"| GiB: {' / '.join(w2['memory_gib'])} | {' / '.join(str(v) for v in w2['memory_gib'].values())} |")
    if "attention_overrides" in results:
        print(f"| attention launch overrides | {results['attention_overrides']} |")
    if "vllm" in results:
        vllm = results["vllm"]
        assert vllm["output_tokens"] == w2["output_tokens"] and vllm["input_tokens"] == w2["prompt_tokens"], \
            "vLLM ran other requests"
        ratio = vllm["elapsed_s"] / w2["seconds"]
        print(f"| vLLM {vllm['vllm_version']}: seconds / output tok/s (step budget "
              f"{vllm.get('max_num_batched_tokens')}) | {vllm['elapsed_s']} / {vllm['vllm_offline_out_tok_per_s']:,} |")
        print(f"| kvserve / vLLM throughput (target >= 1.00x) | {ratio:.3f}x {'met' if ratio >= 1 else 'MISSED'} |")


if __name__ == "__main__":
    main()
