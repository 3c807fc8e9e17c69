"""kvserve against vLLM 0.26.0 on one GPU machine, every row of the quantization / long-context table:
W1 and batch-1 in bf16, with `--quantization fp8` and with AWQ int4; W2 (long context); time to first token of
an 8,192-token prompt; batch-1 decode after an 8,192-token prompt; online serving at 256 streams (output
tok/s and p99 TTFT, both servers driven by `vllm bench serve`). Same dummy Llama-3.1-8B-shaped model, same
requests, greedy, EOS ignored, best of `--passes` with the prefix cache reset before each.

Each part is one device command of under 10 minutes, on the same warm machine (results accumulate in
--results, default /tmp/gpu_compare, and are copied to $OUT); each part prints the table of what is there:

    # after the vLLM bundle is unpacked (bash .vllm/install.sh; BENCHMARKS.md says how the bundle travels)
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_compare.py --part vllm-a    # vLLM bf16 + fp8, ~5 min
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_compare.py --part vllm-b    # vLLM AWQ + W2, ~6 min
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_compare.py --part kvserve --commit COMMIT  # ~6 min
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_compare.py --part online   # both servers, ~6 min
    python3 benchmarks/gpu_compare.py --part table --results DIR [DIR ...]   # here, from the $OUT folders

vLLM runs as the bundle's own `vllm_bench.py` (run, not copied: W1 = its make_workload(), batch-1 = its
make_latency_prompt(), W2 = its make_long_workload(); `--workload w2 --latency-in 8192` gives W2, the TTFT at
8k and batch-1 at 8k). kvserve's side builds the same requests here (w2_requests() asserts their totals) and
measures them the same way: W1/W2 seconds of one LLM.generate over all requests; batch-1 tok/s = output tokens
over the seconds of one LLM.generate (prefill included); TTFT = LLM.generate with max_tokens=1 on an idle
engine, best of 5 after 2 warm-ups. Both engines get a 16,384-token step budget (vLLM's default on this card).
kvserve's part also runs the A/B configurations (AB_CONFIGS: a row again with one change of this tree off).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time

RESULTS = "/tmp/gpu_compare"
# vLLM runs: (file tag, vllm_bench.py arguments). Part a then part b, each under 10 minutes.
VLLM_RUNS = {
    "vllm-a": [("bf16", []), ("fp8", ["--extra", '{"quantization": "fp8"}'])],
    "vllm-b": [("awq", ["--shape", "8b-awq"]), ("w2", ["--workload", "w2", "--latency-in", "8192"])],
}
W2_MAX_MODEL_LEN = 16384
LONG_PROMPT = 8192
# A/B configurations: a measured configuration again with one of this tree's changes turned off, in the same
# command (name -> (the configuration it repeats, {"module.attribute[.attribute]": value})).
AB_CONFIGS = {
    "fp8-unfused": ("fp8", {"kvserve.model.quantization.fp8.FUSE_ACTIVATION_QUANT": False}),
    "w2-short-tiles": ("w2", {"kvserve.ops.triton_attention.TritonAttentionBackend.LONG_PREFILL_MIN_QUERY": 1 << 30}),
}


def w2_requests() -> list[tuple[list[int], int]]:
    """W2: 64 requests, prompts of 6,000-15,000 random ids, 128-512 outputs, from random.Random(2)."""
    rng = random.Random(2)
    reqs = []
    for _ in range(64):
        in_len = rng.randint(6000, 15000)
        out_len = rng.randint(128, 512)
        reqs.append(([rng.randint(100, 119999) for _ in range(in_len)], out_len))
    assert sum(len(p) for p, _ in reqs) == 713959 and sum(o for _, o in reqs) == 20920
    return reqs


def long_prompt() -> list[int]:
    """The 8,192-token prompt: random.Random(1)'s first ids, as vllm_bench's make_latency_prompt(in_len=8192)."""
    rng = random.Random(1)
    return [rng.randint(100, 119999) for _ in range(LONG_PROMPT)]


def set_attributes(values: dict) -> dict:
    """Sets module (or class) attributes by dotted path; returns what restores them."""
    import importlib

    old = {}
    for path, value in values.items():
        parts = path.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the longest importable prefix is the module
            try:
                owner = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        for name in parts[i:-1]:
            owner = getattr(owner, name)
        old[path] = getattr(owner, parts[-1])
        setattr(owner, parts[-1], value)
    return old


def save(results_dir: str, name: str, data: dict) -> None:
    os.makedirs(results_dir, exist_ok=True)
    for folder in {results_dir, os.environ.get("OUT") or results_dir}:
        with open(os.path.join(folder, name), "w") as f:
            json.dump(data, f, indent=1)


# ---- vLLM ----------------------------------------------------------------------------------------
def run_vllm(part: str, args) -> None:
    script = os.path.join(args.bundle, "vllm_bench.py")
    if not os.path.exists(script) or not os.path.isdir("/tmp/vllmsite/vllm"):
        raise SystemExit(f"vLLM bundle not ready: need {script} and /tmp/vllmsite (run bash {args.bundle}/install.sh)")
    for tag, extra in VLLM_RUNS[part]:
        env = {**os.environ, "OUT": args.results, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, script, "--passes", str(args.passes), "--tag", f"_{tag}", *extra]
        print("==", " ".join(cmd), flush=True)
        t = time.perf_counter()
        os.makedirs(args.results, exist_ok=True)
        proc = subprocess.run(cmd, env=env, check=False)
        print(f"== vllm {tag}: rc {proc.returncode} after {time.perf_counter() - t:.0f} s", flush=True)
        produced = os.path.join(args.results, f"vllm_bench_{tag}.json")
        if os.environ.get("OUT") and os.path.exists(produced):
            shutil.copy(produced, os.environ["OUT"])


def run_online(args) -> None:
    """The online row: the bundle's serve_bench.sh (run as shipped) serves the same dummy W1 model with `vllm
    serve` and then `kvserve serve` (this tree), each driven by vLLM's `vllm bench serve` client with the same
    arguments (512 random prompts of 512 tokens, 256 output tokens, 256 concurrent streams); their result files
    are kept as online_serve.json."""
    script = os.path.join(args.bundle, "serve_bench.sh")
    if not os.path.exists(script):
        raise SystemExit(f"vLLM bundle not ready: need {script}")
    out = os.path.join(args.results, "online")
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "OUT": out, "KVSERVE_PATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    t = time.perf_counter()
    proc = subprocess.run(["bash", script], env=env, check=False)
    print(f"== serve_bench.sh: rc {proc.returncode} after {time.perf_counter() - t:.0f} s", flush=True)
    results = {}
    for engine in ("vllm", "kvserve"):
        path = os.path.join(out, f"{engine}_serve.json")
        if os.path.exists(path):
            with open(path) as f:
                r = json.load(f)
            results[engine] = {key: r.get(key) for key in ("output_throughput", "p99_ttft_ms", "median_ttft_ms",
                                                           "p99_tpot_ms", "completed", "num_prompts", "duration")}
        else:
            results[engine] = {"error": f"no {engine}_serve.json (see {engine}_serve.log)"}
    results["kvserve_commit"] = args.commit
    save(args.results, "online_serve.json", results)


def kernel_profile(llm, reqs, label: str, top: int = 12) -> dict:
    """The GPU kernels of one generate over `reqs` (torch.profiler, CUDA activity): the `top` kernels by GPU
    time with their share, so a missed target names the kernel where its time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_w1 import run_kvserve

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_kvserve(llm, reqs, f"profile_{label}", {})
        torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        gpu_us = getattr(event, "self_device_time_total", None)
        if gpu_us is None:
            gpu_us = getattr(event, "self_cuda_time_total", 0)
        if gpu_us > 0:
            kernels.append((gpu_us, event.count, event.key))
    total = sum(us for us, _, _ in kernels) or 1.0
    kernels.sort(reverse=True)
    rows = [{"kernel": name[:90], "gpu_ms": round(us / 1e3, 2), "calls": count, "share": round(us / total, 3)}
            for us, count, name in kernels[:top]]
    print(f"profile {label}: {total / 1e3:,.1f} ms of GPU kernels")
    for r in rows:
        print(f"  {r['share']:6.1%} {r['gpu_ms']:9.2f} ms {r['calls']:7d}x  {r['kernel']}")
    return {"gpu_kernel_ms": round(total / 1e3, 1), "top": rows}


# ---- kvserve -------------------------------------------------------------------------------------
def apply_kernel_paths(path: str, res: dict) -> None:
    """The quantized-linear selection tables written by `benchmarks/ab_kernels.py` on this machine
    (kernel_paths.json), in place of the ones in the code, for the whole part; kept in the results."""
    from kvserve.model.quantization import fp8_matmul, int_matmul

    with open(path) as f:
        tables = json.load(f)
    kinds = {"INT_PATHS": (int_matmul, int_matmul.IntPath), "FP8_PATHS": (fp8_matmul, fp8_matmul.Fp8Path)}
    for name, entries in tables.items():
        module, entry = kinds[name]
        setattr(module, name, tuple(entry(rows, kernel, None if config is None else tuple(config))
                                    for rows, kernel, config in entries))
        print(f"kernel paths: {name} = {getattr(module, name)}", flush=True)
    res["kernel_paths"] = tables


def run_kvserve_part(args) -> None:
    import torch

    from benchmarks.gpu_quant import AWQ_GROUP, awq_served_tensors, copy_into, release_device_memory
    from benchmarks.gpu_w1 import W1_CONFIG, batch1_request, measure_ttft, run_kvserve, w1_requests, write_config
    from kvserve import LLM

    res = {"kvserve_commit": args.commit, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs}
    import triton

    res["triton"] = triton.__version__
    common = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    w1 = w1_requests()
    path = write_config(W1_CONFIG)

    def best_of(llm, reqs, label, into):
        runs = []
        for i in range(args.passes):
            one = {}
            run_kvserve(llm, reqs, label, one)
            runs.append(one[label])
        into[label] = min(runs, key=lambda r: r["seconds"])
        into[label]["passes_s"] = [r["seconds"] for r in runs]

    def w1_rows(name, llm):
        rows = {}
        run_kvserve(llm, [(p, 16) for p, _ in w1[:8]], "warmup", {})
        best_of(llm, [batch1_request()], "batch1", rows)
        best_of(llm, w1, "w1", rows)
        if args.profile and name not in AB_CONFIGS:  # decode-heavy: W1's prompts with 64 output tokens each
            rows["profile"] = kernel_profile(llm, [(p, 64) for p, _ in w1], name)
        res[name] = rows
        save(args.results, "kvserve.json", res)

    if args.kernel_paths:
        apply_kernel_paths(args.kernel_paths, res)
    awq_tensors = float_params = None
    for label in args.configs.split(","):
        name, knobs = AB_CONFIGS.get(label, (label, {}))
        t = time.perf_counter()
        llm = None
        restore = {}
        try:
            restore = set_attributes(knobs)
            if name == "bf16":
                llm = LLM(path, max_model_len=4096, **common)
                w1_rows(label, llm)
                if "awq" in args.configs:  # the AWQ engine serves these bf16 weights quantized (gpu_quant.py)
                    model = llm.llm_engine.executor.runner.model
                    awq_tensors = awq_served_tensors(model)
                    float_params = {n: p.detach().cpu() for n, p in model.named_parameters()
                                    if not n.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight",
                                                       "down_proj.weight"))}
                    model = None
            elif name == "fp8":
                llm = LLM(path, max_model_len=4096, quantization="fp8", **common)
                w1_rows(label, llm)
            elif name == "awq":
                cfg = dict(W1_CONFIG, quantization_config={"quant_method": "awq", "bits": 4, "group_size": AWQ_GROUP,
                                                           "zero_point": True, "version": "gemm"})
                llm = LLM(write_config(cfg), max_model_len=4096, **common)
                if awq_tensors is not None:
                    copy_into(llm.llm_engine.executor.runner.model, awq_tensors, float_params)
                w1_rows(label, llm)
            elif name == "w2":
                llm = LLM(path, max_model_len=W2_MAX_MODEL_LEN, **common)
                rows = {}
                run_kvserve(llm, [(p[:2048], 16) for p, _ in w2_requests()[:4]], "warmup", {})
                measure_ttft(llm, LONG_PROMPT, rows)
                best_of(llm, [(long_prompt(), 512)], "batch1_8k", rows)
                best_of(llm, w2_requests(), "w2", rows)
                if args.profile and label not in AB_CONFIGS:  # the prefill of the 8,192-token prompt
                    rows["profile"] = kernel_profile(llm, [(long_prompt(), 1)], label)
                res[label] = rows
                save(args.results, "kvserve.json", res)
            else:
                raise ValueError(f"unknown config {name!r}")
        except Exception as exc:  # one failing configuration must not hide the others' numbers
            logging.exception("kvserve %s failed", label)
            res[label] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            save(args.results, "kvserve.json", res)
        finally:
            set_attributes(restore)
        if knobs:
            res[label]["knobs"] = knobs
            save(args.results, "kvserve.json", res)
        print(f"== kvserve {label}: {time.perf_counter() - t:.0f} s", flush=True)
        llm = None
        release_device_memory()


# ---- the table -----------------------------------------------------------------------------------
def load(dirs: list[str]) -> tuple[dict, dict]:
    """(kvserve.json, {tag: vllm_bench_<tag>.json}) from the given folders; a later folder wins."""
    ours, vllm = {}, {}
    for d in dirs:
        path = os.path.join(d, "kvserve.json")
        if os.path.exists(path):
            with open(path) as f:
                ours.update(json.load(f))
        for path in glob.glob(os.path.join(d, "vllm_bench_*.json")):
            with open(path) as f:
                vllm[os.path.basename(path)[len("vllm_bench_"):-len(".json")]] = json.load(f)
        path = os.path.join(d, "online_serve.json")
        if os.path.exists(path):
            with open(path) as f:
                online = json.load(f)
            vllm["online"] = online.get("vllm", {})
            ours["online"] = online.get("kvserve", {})
    return ours, vllm


def table_rows(ours: dict, vllm: dict) -> list[tuple[str, float | None, float | None, bool]]:
    """(measure, vLLM, kvserve, higher is better); None where that engine's run is missing."""

    def v(tag, key, scale=1.0):
        value = vllm.get(tag, {}).get(key)
        return None if value is None else value * scale

    def k(config, row, key):
        return ours.get(config, {}).get(row, {}).get(key) if row else ours.get(config, {}).get(key)

    return [
        ("W1 bf16, output tok/s", v("bf16", "vllm_offline_out_tok_per_s"), k("bf16", "w1", "output_tok_s"), True),
        ("batch-1 bf16, tok/s", v("bf16", "bs1_out_tok_per_s"), k("bf16", "batch1", "output_tok_s"), True),
        ("W1 fp8, output tok/s", v("fp8", "vllm_offline_out_tok_per_s"), k("fp8", "w1", "output_tok_s"), True),
        ("batch-1 fp8, tok/s", v("fp8", "bs1_out_tok_per_s"), k("fp8", "batch1", "output_tok_s"), True),
        ("W1 AWQ int4, output tok/s", v("awq", "vllm_offline_out_tok_per_s"), k("awq", "w1", "output_tok_s"), True),
        ("batch-1 AWQ int4, tok/s", v("awq", "bs1_out_tok_per_s"), k("awq", "batch1", "output_tok_s"), True),
        ("W2 long context, seconds for the whole run", v("w2", "elapsed_s"), k("w2", "w2", "seconds"), False),
        ("TTFT of an 8,192-token prompt, ms", v("w2", "bs1_prefill_plus_1tok_s", 1e3), k("w2", None, "ttft_8192_ms"),
         False),
        ("batch-1 decode at 8,192 tokens of context, tok/s", v("w2", "bs1_out_tok_per_s"),
         k("w2", "batch1_8k", "output_tok_s"), True),
        ("online, 256 streams (`vllm bench serve`), output tok/s", v("online", "output_throughput"),
         k("online", None, "output_throughput"), True),
        ("online, 256 streams, p99 TTFT ms", v("online", "p99_ttft_ms"), k("online", None, "p99_ttft_ms"), False),
    ]


def print_table(dirs: list[str]) -> None:
    ours, vllm = load(dirs)
    version = next((r.get("vllm_version") for r in vllm.values() if r.get("vllm_version")), "not run")
    print(f"\nkvserve {ours.get('kvserve_commit', 'not run')} ({ours.get('device', '?')}, torch {ours.get('torch', '?')}, "
          f"triton {ours.get('triton', '?')}); vLLM {version}")
    errors = {name: r["error"] for name, r in ours.items() if isinstance(r, dict) and "error" in r}
    for name, error in errors.items():
        print(f"kvserve {name} FAILED: {error}")
    for tag, r in vllm.items():
        if r.get("output_tokens") != r.get("expected_output_tokens"):
            print(f"vLLM {tag}: produced {r.get('output_tokens')} output tokens, expected {r.get('expected_output_tokens')}")
    print("| measure | vLLM | kvserve | ratio (> 1: kvserve ahead) |\n|---|---|---|---|")
    for name, theirs, mine, higher in table_rows(ours, vllm):
        ratio = "" if theirs is None or mine is None else f"{(mine / theirs if higher else theirs / mine):.2f}x"
        shown = ["not run" if x is None else f"{x:,.1f}" for x in (theirs, mine)]
        print(f"| {name} | {shown[0]} | {shown[1]} | {ratio} |")
    ab = [(label, base) for label, (base, _) in AB_CONFIGS.items() if label in ours and "error" not in ours[label]]
    if ab:
        print("\n| A/B, kvserve only | this tree | with the change off | this tree vs off |\n|---|---|---|---|")
    for label, base in ab:
        for row, key, higher in (("w1", "output_tok_s", True), ("batch1", "output_tok_s", True),
                                 ("w2", "seconds", False), ("batch1_8k", "output_tok_s", True)):
            now, off = ours.get(base, {}).get(row, {}).get(key), ours[label].get(row, {}).get(key)
            if now is not None and off is not None:
                print(f"| {base} {row} {key} vs {label} ({ours[label].get('knobs')}) | {now:,.1f} | {off:,.1f} | "
                      f"{(now / off if higher else off / now):.2f}x |")
        if base == "w2" and "ttft_8192_ms" in ours.get(base, {}):
            now, off = ours[base]["ttft_8192_ms"], ours[label]["ttft_8192_ms"]
            print(f"| w2 ttft_8192_ms vs {label} | {now:,.1f} | {off:,.1f} | {off / now:.2f}x |")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("KVSERVE_COMMIT", "unknown (pass --commit)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", required=True, choices=["vllm-a", "vllm-b", "kvserve", "online", "table"])
    ap.add_argument("--results", nargs="+", default=[RESULTS],
                    help="where results accumulate (the first); `table` reads all of them")
    ap.add_argument("--bundle", default=".vllm", help="the folder holding the vLLM bundle's vllm_bench.py")
    ap.add_argument("--passes", type=int, default=2, help="timed passes of each W1/W2/batch-1 run; the best counts")
    ap.add_argument("--configs", default="bf16,fp8,awq,w2," + ",".join(AB_CONFIGS),
                    help="kvserve configurations to run: bf16, fp8, awq, w2 and the A/B ones (AB_CONFIGS)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the per-kernel profile kept for each configuration")
    ap.add_argument("--kernel-paths", default=None,
                    help="kernel_paths.json from benchmarks/ab_kernels.py: the quantized-linear selection tables to use")
    ap.add_argument("--commit", default=None, help="the kvserve commit measured (default: git, else $KVSERVE_COMMIT)")
    args = ap.parse_args()
    dirs, args.results = args.results, args.results[0]
    args.commit = args.commit or git_commit()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.part in VLLM_RUNS:
        run_vllm(args.part, args)
    elif args.part == "kvserve":
        run_kvserve_part(args)
    elif args.part == "online":
        run_online(args)
    print_table(dirs)


if __name__ == "__main__":
    main()
