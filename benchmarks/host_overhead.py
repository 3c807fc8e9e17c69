"""Host (Python) time per engine step, on the CPU, with a model so small that compute is negligible.

    PYTHONPATH=$PWD python benchmarks/host_overhead.py [--rounds 5] [--profile decode|ttft|none] [--json F]

Host overhead does not depend on model size, so a 2-layer, hidden-64 Llama (dummy weights) shows what the
GPU benchmark's "schedule" and "launch" columns pay per step. Two scenarios:
  decode: 64 requests decoding together (their prefill excluded), async scheduling on as on CUDA;
  ttft:   one 128-token prompt, max_tokens=1, through LLM.generate on an idle engine (prefix cache reset).
Each step's wall time is split like benchmarks/gpu_w1.py's StepTimer: schedule / launch (executor.execute_async:
input building + forward + sampling) / wait (reading sampled ids) / update (scheduler.update); the rest is
output processing and the engine's own bookkeeping. "forward" is the part of launch spent in the model's
forward (eager steps only): the CPU forward changed since f0b00e8 (oneDNN linears, batched attention), so
old and new trees compare on the rest. Every number is per step, best and median over --rounds rounds
(the machine is shared: the best is the least disturbed), plus main-thread CPU time, which other processes'
load does not inflate. Torch runs on one thread so the tiny GEMMs do not wait on thread pools.
The script only uses APIs that existed at f0b00e8, so the same file measures old and new trees.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time

import torch

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
# forward: the model's forward inside launch (on the CPU mostly compute and per-layer Python; on CUDA with
# graphs it is not called for graph-sized steps), so launch - forward is input building + sampling.
PARTS = ("schedule", "launch", "forward", "wait", "update")


class StepTimer:
    """Per-step wall time of schedule / launch / wait / update (as gpu_w1.py's StepTimer), totals reset
    between measurements."""

    def __init__(self, engine):
        from kvserve.worker.runner_output import PendingOutput

        self.reset()
        sched, executor = engine.scheduler, engine.executor
        orig = {"schedule": sched.schedule, "launch": executor.execute_async, "update": sched.update}
        orig_result = PendingOutput.result

        def wrap(name, fn):
            def timed(*a, **kw):
                t, c = time.perf_counter(), time.thread_time()
                r = fn(*a, **kw)
                self.t[name] += time.perf_counter() - t
                self.t[name + "_cpu"] += time.thread_time() - c
                return r
            return timed

        model = engine.runner.model
        model.forward = wrap("forward", model.forward)  # nn.Module.__call__ finds the instance attribute
        sched.schedule = wrap("schedule", orig["schedule"])
        executor.execute_async = wrap("launch", orig["launch"])
        sched.update = wrap("update", orig["update"])
        PendingOutput.result = wrap("wait", orig_result)
        self.restore = lambda: setattr(PendingOutput, "result", orig_result)

    def reset(self):
        self.t = dict.fromkeys(PARTS + tuple(p + "_cpu" for p in PARTS), 0.0)


def write_config() -> str:
    path = tempfile.mkdtemp(prefix="kvserve-host-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f)
    return path


def greedy(max_tokens: int, **kw):
    from kvserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, **kw)


def decode_round(llm, timer, num_reqs=64, prompt_len=32, steps=48, tag="r") -> dict:
    """64 requests: prefill them, then time `steps` decode steps. Final outputs only, as LLM.generate
    (and so gpu_w1.py's W1) asks for."""
    from kvserve.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    rng = random.Random(0)
    params = greedy(steps + 8, output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(num_reqs):
        ids = [rng.randint(3, TINY_CONFIG["vocab_size"] - 1) for _ in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(2):
        engine.step()
    timer.reset()
    t, c = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        engine.step()
    wall, cpu = time.perf_counter() - t, time.thread_time() - c
    res = {"step": wall / steps, "cpu": cpu / steps, **{k: v / steps for k, v in timer.t.items()}}
    res["launch_host_cpu"] = res["launch_cpu"] - res["forward_cpu"]
    while engine.has_unfinished_requests():
        engine.step()
    _sync()
    return res


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def ttft_round(llm, timer, repeats=20) -> dict:
    """One 128-token prompt, max_tokens=1, on an idle engine: best of `repeats` (LLM.generate wall time)."""
    rng = random.Random(1)
    ids = [rng.randint(3, TINY_CONFIG["vocab_size"] - 1) for _ in range(128)]
    engine = llm.llm_engine
    best, best_cpu, parts, steps = float("inf"), float("inf"), None, 0
    for _ in range(repeats):
        engine.kv_cache_manager.reset_prefix_cache()
        timer.reset()
        n0 = _count_steps(engine)
        t, c = time.perf_counter(), time.thread_time()
        llm.generate([{"prompt_token_ids": ids}], greedy(1), use_tqdm=False)
        wall, cpu = time.perf_counter() - t, time.thread_time() - c
        best_cpu = min(best_cpu, cpu)
        if wall < best:
            best, parts, steps = wall, dict(timer.t), _count_steps(engine) - n0
    return {"ttft": best, "cpu": best_cpu, "steps": steps, **parts,
            "launch_host_cpu": parts["launch_cpu"] - parts["forward_cpu"]}


def _count_steps(engine) -> int:
    return getattr(engine, "_host_bench_steps", 0)


def count_steps(engine):
    orig = engine.step

    def step():
        engine._host_bench_steps = getattr(engine, "_host_bench_steps", 0) + 1
        return orig()
    engine.step = step


def summarize(rounds: list[dict]) -> dict:
    keys = rounds[0].keys()
    return {k: {"best": min(r[k] for r in rounds), "median": statistics.median(r[k] for r in rounds),
                "max": max(r[k] for r in rounds)} for k in keys}


def profile(fn, label: str, out: dict) -> None:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    # Python function calls in the scenario: deterministic, so trees compare exactly on a loaded machine.
    out[f"profile_{label}_calls"] = pstats.Stats(prof).total_calls
    print(f"{label}: {out[f'profile_{label}_calls']} Python function calls under cProfile", flush=True)
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(30)
        out[f"profile_{label}_{key}"] = s.getvalue()
        print(f"\n==== cProfile {label}, top 30 by {key} ====\n{s.getvalue()}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", choices=("decode", "ttft", "none"), default="decode")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the same tiny model in bf16 with CUDA graphs, so step time is host time")
    ap.add_argument("--json", help="write results here (default: $OUT/host_overhead.json when $OUT is set)")
    ap.add_argument("--sync", action="store_true", help="async scheduling off (the CPU default)")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    import kvserve
    from kvserve import LLM

    llm = LLM(write_config(), load_format="dummy", skip_tokenizer_init=True, device=args.device,
              dtype="float32" if args.device == "cpu" else "bfloat16", max_model_len=1024, max_num_seqs=128,
              max_num_batched_tokens=4096, kv_cache_memory_bytes=64 << 20, async_scheduling=not args.sync)
    engine = llm.llm_engine
    count_steps(engine)
    timer = StepTimer(engine)
    decode_round(llm, timer, steps=8, tag="warm")
    ttft_round(llm, timer, repeats=3)
    results = {"kvserve": os.path.dirname(kvserve.__file__), "python": sys.version.split()[0],
               "torch": torch.__version__, "device": args.device, "rounds": args.rounds,
               "async_scheduling": engine.async_scheduling}
    for name, fn in (("decode64_per_step", lambda i: decode_round(llm, timer, tag=f"d{i}")),
                     ("ttft128", lambda i: ttft_round(llm, timer))):
        try:  # one scenario failing must not lose the other's numbers
            results[name] = summarize([fn(i) for i in range(args.rounds)])
        except Exception as e:  # noqa: BLE001
            results[name] = {"error": repr(e)}
            print(f"{name} failed: {e!r}", flush=True)
    if args.profile == "decode":
        profile(lambda: decode_round(llm, timer, tag="prof"), "decode64", results)
    elif args.profile == "ttft":
        profile(lambda: ttft_round(llm, timer, repeats=20), "ttft128", results)
    timer.restore()
    path = args.json or (os.path.join(os.environ["OUT"], "host_overhead.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    decode, ttft = results["decode64_per_step"], results["ttft128"]

    def ms(d, key):
        if key not in d:
            return d.get("error", "-")
        s = d[key]
        return f"{s['best'] * 1e3:.3f} / {s['median'] * 1e3:.3f} / {s['max'] * 1e3:.3f}"

    print(f"\nkvserve from {results['kvserve']}; {args.device}; async scheduling {engine.async_scheduling}; "
          f"{args.rounds} rounds; ms, best / median / max")
    print("| measure | decode, 64 requests, per step | TTFT 128-token prompt (whole call) |\n|---|---|---|")
    print(f"| wall | {ms(decode, 'step')} | {ms(ttft, 'ttft')} |")
    print(f"| main-thread CPU | {ms(decode, 'cpu')} | {ms(ttft, 'cpu')} |")
    for part in PARTS:
        print(f"| {part} | {ms(decode, part)} | {ms(ttft, part)} |")
        print(f"| {part}, CPU | {ms(decode, part + '_cpu')} | {ms(ttft, part + '_cpu')} |")
    print(f"| launch - forward, CPU | {ms(decode, 'launch_host_cpu')} | {ms(ttft, 'launch_host_cpu')} |")
    if "steps" in ttft:
        print(f"| engine steps in the TTFT call | | {ttft['steps']['best']} |")


if __name__ == "__main__":
    main()
