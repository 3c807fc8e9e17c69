"""Issue 13's side-by-side table from the files one device session wrote: kvserve's `gpu_w1.json`, vLLM's
`vllm_bench.json` (benchmarks/vllm_reference.py) and the bundle's `serve_bench.sh` output (its two result
JSONs and its log, which holds the ready times). Ratios are vLLM-relative, > 1 means kvserve is better.

    python benchmarks/report_vs_vllm.py --kvserve DIR1/gpu_w1.json --vllm DIR2/vllm_bench.json --serve-dir DIR2
"""

from __future__ import annotations

import argparse
import json
import os
import re


def ready_seconds(log_path: str) -> dict[str, float]:
    """serve_bench.sh prints `== <engine> ready after N s` per engine."""
    with open(log_path) as f:
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"== (\w+) ready after (\d+) s", f.read())}


def rows(ours: dict, vllm: dict, serve: dict | None) -> list[tuple[str, float, float, bool, str]]:
    """(measure, vLLM, kvserve, higher is better, target)"""
    out = [
        ("W1 offline output tok/s", vllm["vllm_offline_out_tok_per_s"], ours["w1"]["output_tok_s"], True, ">= 1.15x"),
        ("batch-1 decode tok/s", vllm["bs1_out_tok_per_s"], ours["batch1"]["output_tok_s"], True, ">= 240 tok/s"),
        ("TTFT 128-token prompt, idle (ms)", vllm["ttft_128_ms"], ours["ttft_128_ms"], False, "<= 6 ms"),
        ("TTFT 2,048-token prompt, idle (ms)", vllm["ttft_2048_ms"], ours["ttft_2048_ms"], False, "<= vLLM"),
        ("LLM(...) start to ready (s)", vllm["init_s"], ours["start_to_ready_s"], False, ""),
    ]
    if serve:
        v, k = serve["vllm"], serve["kvserve"]
        out += [
            ("serve: process start to /health 200 (s)", serve["ready"]["vllm"], serve["ready"]["kvserve"], False,
             "<= 15 s"),
            ("online, 256 streams: output tok/s", v["output_throughput"], k["output_throughput"], True, ">= 1.2x"),
            ("online: mean TTFT (ms)", v["mean_ttft_ms"], k["mean_ttft_ms"], False, ""),
            ("online: p99 TTFT (ms)", v["p99_ttft_ms"], k["p99_ttft_ms"], False, "<= vLLM"),
            ("online: mean TPOT (ms)", v["mean_tpot_ms"], k["mean_tpot_ms"], False, ""),
            ("online: p99 TPOT (ms)", v["p99_tpot_ms"], k["p99_tpot_ms"], False, "<= vLLM"),
        ]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvserve", required=True, help="gpu_w1.json")
    ap.add_argument("--vllm", required=True, help="vllm_bench.json from benchmarks/vllm_reference.py")
    ap.add_argument("--serve-dir", default=None, help="folder with serve_bench.sh's results and its log")
    args = ap.parse_args()
    with open(args.kvserve) as f:
        ours = json.load(f)
    with open(args.vllm) as f:
        vllm = json.load(f)
    serve = None
    if args.serve_dir:
        serve = {"ready": ready_seconds(os.path.join(args.serve_dir, "serve_bench.log"))}
        for engine in ("vllm", "kvserve"):
            with open(os.path.join(args.serve_dir, f"{engine}_serve.json")) as f:
                serve[engine] = json.load(f)
    print(f"{ours.get('device', '?')}, torch {ours.get('torch', '?')}; vLLM {vllm['vllm_version']}")
    print("| measure | vLLM | kvserve | kvserve vs vLLM | target |\n|---|---|---|---|---|")
    for name, theirs, mine, higher_better, target in rows(ours, vllm, serve):
        ratio = mine / theirs if higher_better else theirs / mine
        print(f"| {name} | {theirs:,.2f} | {mine:,.2f} | {ratio:.2f}x | {target} |")
    parity = ours.get("parity", {})
    if parity:
        print(f"| parity: graphs == eager / mixed-step graphs == eager / greedy identical vs HF (bf16) | | "
              f"{parity.get('graphs_equal_eager')} / {parity.get('mixed_graphs_equal_eager')} / "
              f"{parity.get('identical_vs_hf')}/8 | | |")


if __name__ == "__main__":
    main()
