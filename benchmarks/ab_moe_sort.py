"""The MoE layer's small kernels around the grouped GEMMs, this tree against the one before, on the GPU: the pair
sort (kvserve/ops/moe_align.py, against an earlier tree's copy of that file) and the sum of each token's pair
rows (kvserve/ops/moe_sum.py, against the torch expression it replaced). Qwen3-30B-A3B's shape: 128 experts,
top-8, hidden 2,048, the decode steps of W1 (up to 256 tokens, 2,048 pairs) and a few larger ones.

    # the earlier tree, here:  git archive COMMIT | tar -x -C .old   (a folder git ignores; carry it)
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/ab_moe_sort.py --old-tree .old [--out DIR]

Each new result is checked against the torch reference (align_block_size: the same blocks; the sum: the fp32
sum rounded once) before it is timed. Timing: 50 calls captured in one CUDA graph (as the engine's decode steps
run them, without the per-launch host cost), the median of 20 replays, in microseconds per call.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import torch

EXPERTS, TOP_K, HIDDEN = 128, 8, 2048
TOKENS = (16, 64, 128, 256, 512, 1024)
CALLS_PER_GRAPH = 50


def graph_us(fn) -> float:
    from benchmarks.gpu_moe import graph_time_ms

    return round(graph_time_ms(fn, calls=CALLS_PER_GRAPH) * 1e3, 2)


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def same_blocks(got, ref, block_m: int) -> bool:
    """The same rows per expert run (the order inside a run is free) and the same block experts."""
    from tests.kernels.test_moe_align import expert_runs

    return (int(got[2]) == int(ref[2]) and got[1].cpu().tolist() == ref[1].tolist()
            and expert_runs(got, block_m) == expert_runs(ref, block_m))


def routing(tokens: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
    return torch.topk(logits, TOP_K).indices.to(torch.int32)


def sort_rows(old_align) -> list[dict]:
    from kvserve.ops import fused_moe, moe_align

    rows = []
    for tokens in TOKENS:
        ids = routing(tokens)
        pairs = tokens * TOP_K
        block_m = fused_moe._gemm_config(pairs, EXPERTS, TOP_K, fp8=True)["BLOCK_M"]
        ref = moe_align.align_block_size(ids.cpu(), EXPERTS, block_m)
        row = {"kernel": "pair sort", "tokens": tokens, "pairs": pairs, "block_m": block_m}
        new = lambda: moe_align.align_block_size_triton(ids, EXPERTS, block_m)  # noqa: E731
        row["same_blocks"] = same_blocks(new(), ref, block_m)
        row["new_us"] = graph_us(new)
        if pairs <= moe_align.ONE_PROGRAM_MAX_PAIRS:  # the two paths of this tree at each size
            for name, above in (("one_program_us", moe_align.ONE_PROGRAM_MAX_PAIRS), ("parallel_us", 0)):
                saved, moe_align.PARALLEL_ABOVE_PAIRS = moe_align.PARALLEL_ABOVE_PAIRS, above
                try:
                    row["same_blocks"] &= same_blocks(new(), ref, block_m)
                    row[name] = graph_us(new)
                finally:
                    moe_align.PARALLEL_ABOVE_PAIRS = saved
        if old_align is not None:
            row["old_us"] = graph_us(lambda: old_align.align_block_size_triton(ids, EXPERTS, block_m))
        rows.append(row)
        print("sort", json.dumps(row), flush=True)
    return rows


def sum_rows() -> list[dict]:
    from kvserve.ops.moe_sum import sum_pairs

    rows = []
    for tokens in TOKENS:
        down = torch.randn(tokens * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16)
        want = down.float().view(tokens, TOP_K, HIDDEN).sum(1).to(torch.bfloat16)
        got = sum_pairs(down, TOP_K)
        row = {"kernel": "pair sum", "tokens": tokens, "pairs": tokens * TOP_K,
               # the same fp32 sum in another order, rounded once: at most one bf16 unit (2^-8 relative) apart
               "max_rel_diff_vs_torch": float(((got.float() - want.float()).abs()
                                               / want.float().abs().clamp_min(1e-3)).max()),
               "old_us": graph_us(lambda: down.view(tokens, TOP_K, HIDDEN).sum(dim=1)),
               "new_us": graph_us(lambda: sum_pairs(down, TOP_K))}
        row["GBps_new"] = round(down.numel() * 2 * (1 + 1 / TOP_K) / row["new_us"] / 1e3, 1)
        rows.append(row)
        print("sum", json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-tree", help="an earlier checkout whose kvserve/ops/moe_align.py is the baseline")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    old = load_module(os.path.join(args.old_tree, "kvserve/ops/moe_align.py"), "old_moe_align") if args.old_tree \
        else None
    rows = sort_rows(old) + sum_rows()
    with open(os.path.join(args.out, "ab_moe_sort.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; us per call (50 calls per CUDA graph)")
    print("| kernel | tokens (pairs) | old us | new us | new / old | this tree: one program / parallel us | check |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        old_us = r.get("old_us")
        ratio = f"{r['new_us'] / old_us:.2f}" if old_us else ""
        paths = f"{r['one_program_us']} / {r['parallel_us']}" if "one_program_us" in r else ""
        check = (("same blocks" if r["same_blocks"] else "DIFFERENT BLOCKS") if "same_blocks" in r
                 else f"max relative diff {r['max_rel_diff_vs_torch']:.3g}")
        print(f"| {r['kernel']} | {r['tokens']} ({r['pairs']}) | {old_us or ''} | {r['new_us']} | {ratio} | {paths} "
              f"| {check} |")
    bad = [r for r in rows if r.get("same_blocks") is False or r.get("max_rel_diff_vs_torch", 0) > 2**-7]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
