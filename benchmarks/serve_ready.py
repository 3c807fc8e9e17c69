"""How long `kvserve serve` takes from process start to /health 200 for the W1 model (Llama-3.1-8B shape,
dummy bf16 weights, a real Llama 3.1 tokenizer when one is given), and where that time goes: each server
log line is printed with the seconds since start. Runs twice: the first start compiles the Triton kernels
(cold cache), the second finds them in Triton's on-disk cache.

    python benchmarks/serve_ready.py --tokenizer-dir DIR_WITH_tokenizer.json [--runs 2] [-- more serve flags]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from benchmarks.gpu_w1 import W1_CONFIG


def start_once(model_dir: str, port: int, flags: list[str], timeout: float = 300.0) -> tuple[float, list[str]]:
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", model_dir, "--load-format", "dummy",
           "--dtype", "bfloat16", "--max-model-len", "4096", "--port", str(port), *flags]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(f"{time.perf_counter() - t0:7.2f}s  {line.rstrip()}")

    threading.Thread(target=read, daemon=True).start()
    ready = None
    while time.perf_counter() - t0 < timeout and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    ready = time.perf_counter() - t0
                    break
        except OSError:
            pass
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    if ready is None:
        raise RuntimeError("server did not become ready:\n" + "\n".join(lines[-30:]))
    return ready, lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", help="folder with tokenizer.json / tokenizer_config.json to serve with")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--port", type=int, default=8101)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("flags", nargs="*", help="more `kvserve serve` flags (after --)")
    args = ap.parse_args()
    model_dir = tempfile.mkdtemp(prefix="kvserve-w1-serve-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(W1_CONFIG, f)
    flags = list(args.flags)
    if args.tokenizer_dir:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(args.tokenizer_dir, name), model_dir)
    else:
        flags.append("--skip-tokenizer-init")
    results = []
    for i in range(args.runs):
        ready, lines = start_once(model_dir, args.port, flags)
        label = "cold Triton cache" if i == 0 else "warm Triton cache"
        print(f"\n== start {i}: ready after {ready:.1f} s ({label}) ==")
        with open(os.path.join(args.out, f"serve_ready_{i}.log"), "w") as f:
            f.write("\n".join(lines))
        print("\n".join(line for line in lines if "GET /health" not in line))
        results.append({"run": i, "ready_s": round(ready, 2), "label": label})
    with open(os.path.join(args.out, "serve_ready.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| start | kvserve serve: process start to /health 200 (s) |\n|---|---|")
    for r in results:
        print(f"| {r['run']} ({r['label']}) | {r['ready_s']} |")


if __name__ == "__main__":
    main()
