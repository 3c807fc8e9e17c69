"""Served vs offline throughput: the same 64 requests through `LLM.generate` and through `kvserve serve`.

    python benchmarks/served_vs_offline.py [--num-prompts 64] [--rounds 3] [--model PATH]

The server must not cost throughput: HTTP, SSE and JSON work runs beside the step loop, never inside it.
Each round runs the offline engine on all requests at once, then sends the same requests to a server
(started once, in its own process, with the same engine flags) as concurrent streaming /v1/completions
calls with token-id prompts, greedy and ignore_eos, so both sides generate exactly the same tokens.
Rounds alternate offline and served, so a noisy shared machine hits both alike; the ratio of each round
and the median are printed, with the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch


def make_requests(n: int, seed: int, vocab: int, in_range: tuple[int, int], out_range: tuple[int, int]):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        in_len, out_len = rng.randint(*in_range), rng.randint(*out_range)
        reqs.append(([rng.randint(100, vocab - 1) for _ in range(in_len)], out_len))
    return reqs


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        load = "load avg %.1f" % os.getloadavg()[0]
    except OSError:
        load = ""
    return (f"{cpu}, {os.cpu_count()} CPUs ({load}), torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")


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
async def _stream_one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tail = b""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        # Raw bytes, keeping only the end: the client shares the machine's cores with the server, so it
        # must not spend them splitting and decoding every chunk. The usage chunk comes last.
        async for data in r.aiter_raw():
            tail = (tail + data)[-4096:]
    events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {") and b'"usage"' in e]
    if not events or not tail.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(f"the stream ended without a usage chunk and [DONE]: {tail[-300:]!r}")
    return json.loads(events[-1][6:])["usage"]["completion_tokens"]


async def _run_served(url: str, model: str, reqs) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=len(reqs) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        t = time.perf_counter()
        counts = await asyncio.gather(*(_stream_one(client, model, p, o) for p, o in reqs))
        return time.perf_counter() - t, sum(counts)


def start_server(engine_flags: list[str], port: int, log) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", *engine_flags, "--port", str(port),
           "--uvicorn-log-level", "warning", "--disable-log-stats"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
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
    raise TimeoutError(f"server not ready; log: {log.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Model path (default: the embedded SmolLM2).")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"))
    ap.add_argument("--rounds", type=int, default=3, help="Alternating offline/served rounds (default 3).")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from kvserve import LLM

    engine_kwargs = {"max_model_len": args.max_model_len}
    engine_flags = ([args.model] if args.model else []) + ["--max-model-len", str(args.max_model_len)]
    llm = LLM(args.model, **engine_kwargs)
    vocab = llm.llm_engine.config.model_config.vocab_size
    model_name = llm.llm_engine.config.served_model_name
    reqs = make_requests(args.num_prompts, args.seed, vocab, tuple(args.input_len), tuple(args.output_len))
    warmup = reqs[:2]
    print(f"machine: {machine()}")
    print(f"workload: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
          f"{sum(o for _, o in reqs)} output tokens; greedy, ignore_eos, all sent at once")

    with tempfile.NamedTemporaryFile("w+", prefix="kvserve-bench-server-", suffix=".log", delete=False) as log:
        proc, url = start_server(engine_flags, args.port, log)
        try:
            run_offline(llm, warmup)
            asyncio.run(_run_served(url, model_name, warmup))
            rows = []
            for r in range(args.rounds):
                off_t, off_n = run_offline(llm, reqs)
                srv_t, srv_n = asyncio.run(_run_served(url, model_name, reqs))
                if off_n != srv_n:
                    raise RuntimeError(f"token counts differ: offline {off_n}, served {srv_n}")
                off_tps, srv_tps = off_n / off_t, srv_n / srv_t
                rows.append((off_tps, srv_tps, srv_tps / off_tps))
                print(f"round {r + 1}: offline {off_tps:7.1f} output tok/s ({off_t:6.1f} s) | served "
                      f"{srv_tps:7.1f} output tok/s ({srv_t:6.1f} s) | served/offline {srv_tps / off_tps:.3f}",
                      flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    ratios = [row[2] for row in rows]
    print(f"offline: {statistics.median(r[0] for r in rows):.1f} output tok/s (median of {len(rows)})")
    print(f"served:  {statistics.median(r[1] for r in rows):.1f} output tok/s (median of {len(rows)})")
    print(f"served/offline: {statistics.median(ratios):.3f} (median; rounds: {', '.join(f'{x:.3f}' for x in ratios)})")
    os.unlink(log.name)


if __name__ == "__main__":
    main()
