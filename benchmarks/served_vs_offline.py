"""Served vs offline throughput: the same requests through `LLM.generate` and through `kvserve serve`.

    python benchmarks/served_vs_offline.py [--num-prompts 64] [--rounds 3] [--model PATH]   # SmolLM2 (CPU)
    python benchmarks/served_vs_offline.py --dataset w1 --rounds 1 --out DIR                  # W1 (GPU)
    python benchmarks/served_vs_offline.py --dataset w1 --tiny --num-prompts 8 --rounds 1     # W1's path, CPU

The server must not cost throughput: HTTP, SSE and JSON work runs beside the step loop, never inside it.
Each round runs the offline engine on all requests at once, then sends the same requests to a server
(started once, in its own process, with the same engine flags) as concurrent streaming /v1/completions
calls with token-id prompts, greedy and ignore_eos, so both sides generate exactly the same tokens.
Rounds alternate offline and served, so a noisy shared machine hits both alike; the ratio of each round
and the median are printed, with the machine, and a short table last.

Datasets: `random` (default; SmolLM2, short random prompts) and `w1`, the GPU reference workload of
docs/DESIGN.md (Llama-3.1-8B's config, dummy bf16 weights, no tokenizer, 256 requests). For W1 both engines
share one GPU, so each gets a fixed KV cache (--kv-cache-tokens) instead of --gpu-memory-utilization,
whose budget counts the other engine's memory as used. `--tiny` runs W1's code path on a 2-layer,
64-wide model with every W1 length cut by 16, so it can be checked on a CPU.

The table counts SSE events per served request: without a tokenizer (W1) the server's deltas carry no
text, and it sends one content chunk per request instead of one per step, so read W1's ratio with that row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

# This checkout's kvserve, for this process and the server's: both sides must run the same code.
REPO = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, REPO)

from kvserve.bench.datasets import W1_CONFIG, W1_MODEL_ALIAS, w1_requests
from kvserve.bench.machine import describe

# W1's engine flags (docs/DESIGN.md, BENCHMARKS.md); w1_workload adds the fixed KV size.
W1_ENGINE = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 4096, "max_num_seqs": 256,
             "max_num_batched_tokens": 16384, "skip_tokenizer_init": True, "served_model_name": W1_MODEL_ALIAS,
             "enable_prefix_caching": False}  # W1 shares no prefixes; on, round 2 would hit round 1's blocks
# 40 GiB of Llama-3.1-8B KV (128 KiB a token): all 256 W1 requests at full length need 298,208 tokens
# (in blocks of 16), so neither engine can preempt, and two engines + weights fit on one H200.
W1_KV_TOKENS = 327_680
# --tiny: W1's shape scaled down; the vocabulary stays, since W1's ids go up to 119,999.
TINY_OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16}
TINY_LEN_DIVISOR = 16
WARMUP_REQUESTS, WARMUP_TOKENS = 8, 16
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def make_requests(n: int, seed: int, vocab: int, in_range: tuple[int, int], out_range: tuple[int, int]):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        in_len, out_len = rng.randint(*in_range), rng.randint(*out_range)
        reqs.append(([rng.randint(100, vocab - 1) for _ in range(in_len)], out_len))
    return reqs


def machine() -> str:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        load = f", load avg {os.getloadavg()[0]:.1f}"  # a busy shared CPU explains odd numbers
    except OSError:
        load = ""
    return f"{describe(device)}{load}, Python {platform.python_version()}"


# ---- workloads -----------------------------------------------------------------------------------------
def kv_bytes_per_token(cfg: dict, dtype: str) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * DTYPE_BYTES[dtype]


def w1_workload(args, tmpdir: str) -> tuple[str, dict, list]:
    """(model dir, engine kwargs, requests) for W1, or for its tiny CPU stand-in."""
    cfg = {**W1_CONFIG, **TINY_OVERRIDES} if args.tiny else W1_CONFIG
    with open(os.path.join(tmpdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    engine = dict(W1_ENGINE, kv_cache_memory_bytes=args.kv_cache_tokens * kv_bytes_per_token(cfg, W1_ENGINE["dtype"]))
    reqs = [(r.prompt_token_ids, r.expected_output_len) for r in w1_requests(args.num_prompts)]
    if args.tiny:
        reqs = [(p[:max(1, len(p) // TINY_LEN_DIVISOR)], max(1, o // TINY_LEN_DIVISOR)) for p, o in reqs]
    return tmpdir, engine, reqs


def engine_flags(model: str | None, engine: dict) -> list[str]:
    """The server's command line for the offline engine's kwargs, so both sides run the same engine."""
    flags = [model] if model else []
    for name, value in engine.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


# ---- offline -------------------------------------------------------------------------------------------
def run_offline(llm, reqs) -> tuple[float, int]:
    from kvserve import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


# ---- served --------------------------------------------------------------------------------------------
async def _stream_one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> tuple[int, int]:
    """(completion tokens from the usage chunk, SSE events received)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tail = b""
    events = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        # Raw bytes, keeping only the end: the client shares the machine's cores with the server, so it
        # must not spend them splitting and decoding every chunk. The usage chunk comes last. Events end
        # in a blank line; the previous read's last byte catches a "\n\n" split between two reads.
        async for data in r.aiter_raw():
            events += (tail[-1:] + data).count(b"\n\n")
            tail = (tail + data)[-4096:]
    usage = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {") and b'"usage"' in e]
    if not usage or not tail.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(f"the stream ended without a usage chunk and [DONE]: {tail[-300:]!r}")
    return json.loads(usage[-1][6:])["usage"]["completion_tokens"], events


async def _run_served(url: str, model: str, reqs, max_concurrency: int | None) -> tuple[float, int, int]:
    """(seconds, output tokens, SSE events) for all requests, at most max_concurrency in flight."""
    width = min(max_concurrency or len(reqs), len(reqs))
    gate = asyncio.Semaphore(width)
    limits = httpx.Limits(max_connections=width + 8, max_keepalive_connections=width + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:

        async def one(p, o):
            async with gate:
                return await _stream_one(client, model, p, o)

        t = time.perf_counter()
        results = await asyncio.gather(*(one(p, o) for p, o in reqs))
        return time.perf_counter() - t, sum(n for n, _ in results), sum(e for _, e in results)


def served_preemptions(url: str) -> int | None:
    """The server's cumulative preemptions, from /metrics (None if the metric is missing)."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("kvserve:num_preemptions_total"):
            return int(float(line.split()[-1]))
    return None


def start_server(engine_args: list[str], port: int, log, timeout_s: float) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", *engine_args, "--port", str(port),
           "--uvicorn-log-level", "warning", "--disable-log-stats"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server not ready after {timeout_s:.0f} s; log: {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def print_log_tail(path: str, lines: int = 40) -> None:
    """On the GPU machine nobody can open the log afterwards: show why the server failed."""
    try:
        with open(path, errors="replace") as f:
            tail = f.readlines()[-lines:]
    except OSError:
        return
    print(f"---- last {len(tail)} lines of {path} ----", file=sys.stderr)
    sys.stderr.writelines(tail)


# ---- the run -------------------------------------------------------------------------------------------
def process_tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of `pid` and its descendants, by process name (Linux /proc; {} elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    raw = f.read()
            except OSError:
                continue
            name = raw[raw.index("(") + 1:raw.rindex(")")]
            fields = raw[raw.rindex(")") + 2:].split()
            stats[int(entry)] = (name, int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        if p in stats:
            name, _, cpu = stats[p]
            tree["server (HTTP)" if p == pid else f"server child {name}[{p}]"] = cpu
            frontier += [c for c, (_, ppid, _) in stats.items() if ppid == p]
    return tree


def cpu_use(before: dict, after: dict, client: float, seconds: float) -> dict[str, float]:
    """Busy fraction of one core per process over a run: one near 1.0 is what limits served throughput
    (the engine core's includes spinning while it waits for the GPU)."""
    use = {k: round((after[k] - before.get(k, 0.0)) / seconds, 2) for k in after}
    use["client (this process)"] = round(client / seconds, 2)
    return use


def run_rounds(llm, url: str, model_name: str, reqs, args, server_pid: int) -> list[dict]:
    expected = sum(o for _, o in reqs)
    rows = []
    for r in range(args.rounds):
        off_t, off_n = run_offline(llm, reqs)
        cpu_before, client_before = process_tree_cpu(server_pid), time.process_time()
        srv_t, srv_n, events = asyncio.run(_run_served(url, model_name, reqs, args.max_concurrency))
        cpu = cpu_use(cpu_before, process_tree_cpu(server_pid), time.process_time() - client_before, srv_t)
        print(f"round {r + 1}: CPU busy (cores) while serving: {cpu}", flush=True)
        if not off_n == srv_n == expected:
            raise RuntimeError(f"output tokens differ: offline {off_n}, served {srv_n}, expected {expected}")
        row = {"offline_s": off_t, "served_s": srv_t, "output_tokens": off_n, "offline_tok_s": off_n / off_t,
               "served_tok_s": srv_n / srv_t, "ratio": off_t / srv_t,  # = served tok/s / offline tok/s
               "sse_events_per_request": events / len(reqs), "served_cpu_busy": cpu}
        rows.append(row)
        print(f"round {r + 1}: offline {row['offline_tok_s']:7.1f} output tok/s ({off_t:6.1f} s) | served "
              f"{row['served_tok_s']:7.1f} output tok/s ({srv_t:6.1f} s) | served/offline {row['ratio']:.3f}",
              flush=True)
    return rows


def summarize(rows: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("offline_tok_s", "served_tok_s", "ratio", "offline_s", "served_s", "sse_events_per_request")}
    med["rounds"] = [round(r["ratio"], 3) for r in rows]
    return med


def print_table(med: dict, n_rounds: int, preempt: dict, header: str) -> None:
    print(f"\n{header}")
    print("| measure | offline | served | served/offline |\n|---|---|---|---|")
    print(f"| output tok/s (median of {n_rounds}) | {med['offline_tok_s']:.1f} | {med['served_tok_s']:.1f} | "
          f"**{med['ratio']:.3f}** (rounds: {', '.join(f'{x:.3f}' for x in med['rounds'])}) |")
    print(f"| seconds (median) | {med['offline_s']:.2f} | {med['served_s']:.2f} | |")
    print(f"| preemptions (all runs) | {preempt['offline']} | {preempt['served']} | |")
    print(f"| SSE events per request | - | {med['sse_events_per_request']:.1f} | |")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=("random", "w1"), default="random",
                    help="random: SmolLM2 (or --model) and random short prompts; w1: docs/DESIGN.md's W1.")
    ap.add_argument("--tiny", action="store_true", help="w1 only: a 2-layer, 64-wide model, lengths cut by 16 (CPU).")
    ap.add_argument("--model", default=None, help="random only: model path (default: the embedded SmolLM2).")
    ap.add_argument("--num-prompts", type=int, default=None, help="Requests (default: 64; w1: 256).")
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"), help="random only.")
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"), help="random only.")
    ap.add_argument("--max-model-len", type=int, default=1024, help="random only (w1: 4096).")
    ap.add_argument("--kv-cache-tokens", type=int, default=W1_KV_TOKENS,
                    help=f"w1 only: each engine's fixed KV cache, in tokens (default {W1_KV_TOKENS:,}: 40 GiB).")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="Most served requests in flight (default: all at once). Offline always gets all at once.")
    ap.add_argument("--rounds", type=int, default=3, help="Alternating offline/served rounds (default 3).")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--seed", type=int, default=0, help="random only.")
    ap.add_argument("--server-start-timeout", type=float, default=300.0,
                    help="Seconds to wait for the server's /health (default 300: W1 on a GPU needs ~20).")
    ap.add_argument("--out", default=None, help="Directory for served_vs_offline.json and the server's log.")
    args = ap.parse_args()
    if args.tiny and args.dataset != "w1":
        ap.error("--tiny goes with --dataset w1")
    if args.dataset == "w1" and args.model:
        ap.error("--dataset w1 builds its own model (Llama-3.1-8B's config, dummy weights); drop --model")
    if args.num_prompts is None:
        args.num_prompts = 256 if args.dataset == "w1" else 64
    if args.rounds < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        ap.error("--rounds and --max-concurrency must be >= 1")
    return args


def load_offline(args, tmpdir: str):
    """(LLM, model, engine kwargs, requests): the offline engine and the workload it and the server run."""
    from kvserve import LLM

    if args.dataset == "w1":
        model, engine, reqs = w1_workload(args, tmpdir)
        return LLM(model, **engine), model, engine, reqs
    # No prefix caching on either side: a later round would find the earlier rounds' prompts cached.
    model, engine = args.model, {"max_model_len": args.max_model_len, "enable_prefix_caching": False}
    llm = LLM(model, **engine)
    vocab = llm.llm_engine.config.model_config.vocab_size
    reqs = make_requests(args.num_prompts, args.seed, vocab, tuple(args.input_len), tuple(args.output_len))
    return llm, model, engine, reqs


def open_server_log(out: str | None):
    """Under --out the log comes back with the results (from the GPU machine too); else a temp file."""
    if out:
        return open(os.path.join(out, "served_vs_offline_server.log"), "w+")
    return tempfile.NamedTemporaryFile("w+", prefix="kvserve-bench-server-", suffix=".log", delete=False)


def measure(llm, model: str | None, engine: dict, reqs, args, log) -> tuple[list[dict], dict]:
    """Starts the server, warms both sides up, runs the rounds; (rows, facts about the run)."""
    model_name = llm.llm_engine.config.served_model_name
    t = time.perf_counter()
    try:
        proc, url = start_server(engine_flags(model, engine), args.port, log, args.server_start_timeout)
    except Exception:
        print_log_tail(log.name)
        raise
    facts = {"server_ready_s": round(time.perf_counter() - t, 1)}
    print(f"server ready after {facts['server_ready_s']} s", flush=True)
    try:
        # Warm-up: first-call costs (kernel JIT, allocator growth, connections) stay out of round 1.
        warmup = [(p, min(o, WARMUP_TOKENS)) for p, o in reqs[:WARMUP_REQUESTS]]
        run_offline(llm, warmup)
        asyncio.run(_run_served(url, model_name, warmup, None))
        rows = run_rounds(llm, url, model_name, reqs, args, proc.pid)
        facts["preemptions"] = {"offline": llm.llm_engine.get_stats().num_preemptions,
                                "served": served_preemptions(url)}
    except Exception:
        print_log_tail(log.name)
        raise
    finally:
        stop_server(proc)
    return rows, facts


def git_commit() -> str | None:
    """The commit measured, '+dirty' with local changes (None where the tree has no .git, e.g. a copy)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def main() -> None:
    args = parse_args()
    # kvserve's INFO (KV size, graph capture, load times) comes before the rounds; httpx's per-request
    # lines would bury the output, so other libraries log warnings only.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("kvserve").setLevel(logging.INFO)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvserve-svo-") as tmpdir:
        t = time.perf_counter()
        llm, model, engine, reqs = load_offline(args, tmpdir)
        offline_ready_s = round(time.perf_counter() - t, 1)
        concurrency = min(args.max_concurrency or len(reqs), len(reqs))
        workload = (f"{args.dataset}{' (tiny)' if args.tiny else ''}: {len(reqs)} requests, "
                    f"{sum(len(p) for p, _ in reqs)} prompt tokens, {sum(o for _, o in reqs)} output tokens; "
                    f"greedy, ignore_eos; served: {concurrency} streams at once")
        header = f"machine: {machine()}\nworkload: {workload}"
        print(header)
        print(f"offline engine ready after {offline_ready_s} s; engine flags (both sides): "
              f"{' '.join(engine_flags(model, engine))}", flush=True)
        with open_server_log(args.out) as log:
            rows, facts = measure(llm, model, engine, reqs, args, log)
        if not args.out:
            os.unlink(log.name)

    med = summarize(rows)
    if args.out:
        result = {"machine": machine(), "commit": git_commit(), "command": sys.argv, "workload": workload,
                  "engine": engine, "offline_ready_s": offline_ready_s, **facts,
                  "warmup": f"first {WARMUP_REQUESTS} requests, {WARMUP_TOKENS} output tokens, both sides",
                  "rounds": rows, "median": med}
        Path(args.out, "served_vs_offline.json").write_text(json.dumps(result, indent=1))
    print_table(med, len(rows), facts["preemptions"], header)


if __name__ == "__main__":
    main()
