"""Tile configurations of the fused-MoE grouped GEMM (kvserve/ops/fused_moe.py) on the GPU, each checked first.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/sweep_moe_tiles.py [--out $OUT] [--quick: Qwen3 only]
        [--tokens 256,1024] [--kinds fp8_w8a8]

For the Qwen3-30B-A3B expert shape (128 experts, top-8, hidden 2048, width 768) and Mixtral-8x7B's (8, top-2,
4096, 14336), bf16 experts and fp8 experts on the W8A8 path, at token counts from a batch-1 decode step to a
prefill chunk: the whole routed-experts call (sort, both GEMMs, SiLU-and-mul, the sum) timed as CUDA-graph
replays (median) with
* "previous": the tile table before one-block-per-pair steps (every step sorted, BLOCK_M 16 up to 4 pairs
  per expert), the baseline of this command's ratios;
* "current": `_gemm_config` as it is;
* every candidate in CANDIDATES that fits the step (one-block-per-pair only up to 64 pairs; each short row
  block also with the transposed product, SWAP_AB; for fp8 also FP8_CANDIDATES, deeper tiles), then the down projection's own tiles (DOWN_CANDIDATES)
  on the best, then for fp8 the best with FAST_ACCUM; each output checked against the current
  configuration's (|diff| / |out| < 1e-2, Euclidean norms: W8A8 tiles may round an activation to the other
  e4m3 neighbour; a candidate that fails, or does not compile, is reported and skipped);
* the same call through torch's grouped GEMM (kvserve/ops/moe_grouped_mm.py: CUTLASS on Hopper), and with
  the parallel pair sort (kvserve/ops/moe_align.py; one-block-per-pair steps have no sort), checked the same
  way.
Prints the best candidate per row and its time relative to "previous" and "current", and the expert-weight
bytes each call reads per second. JSON goes to OUT/sweep_moe_tiles.json (each row's best tiles included:
`table_from_sweep` turns it into a tile table the engine can run on); a markdown table is printed last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

from benchmarks.gpu_compare import set_attributes
from benchmarks.gpu_moe import graph_time_ms
from kvserve.ops.fused_moe import _tiles

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 2048, 8192)


CANDIDATES = (
    [_tiles(True, 16, n, k, 1, w, st) for n, k, w, st in (
        (16, 128, 2, 4), (16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (32, 128, 2, 5), (64, 128, 4, 3),
        (64, 256, 4, 3), (64, 128, 8, 4), (32, 128, 2, 6), (32, 64, 2, 6), (128, 128, 4, 3),
        (128, 64, 4, 4))]
    + [_tiles(False, m, n, k, g, w, st) for m, n, k, g, w, st in (
        (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 3), (16, 64, 256, 1, 4, 3), (16, 128, 128, 1, 4, 3),
        (32, 64, 64, 4, 4, 3), (32, 64, 128, 4, 4, 4), (32, 128, 128, 4, 4, 3), (32, 64, 256, 4, 4, 3),
        (32, 128, 128, 4, 8, 4), (32, 64, 128, 4, 4, 5), (32, 32, 256, 4, 4, 3), (32, 64, 128, 4, 8, 4),
        (64, 64, 128, 8, 4, 4), (64, 128, 64, 8, 4, 3), (64, 128, 128, 8, 4, 3), (64, 128, 128, 8, 8, 4),
        (64, 256, 128, 8, 8, 3), (128, 128, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3), (128, 256, 64, 8, 8, 3))]
)
# fp8 (W8A8) tiles hold half the bytes of bf16 ones at the same shape: deeper in K, wider in N, more stages, so a
# program keeps as many weight bytes in flight; GROUP_M 1 (each sorted block is one expert: grouping shares no tile).
FP8_CANDIDATES = [_tiles(False, m, n, k, g, w, st) for m, n, k, g, w, st in (
    (16, 64, 256, 1, 4, 4), (16, 128, 256, 1, 4, 3), (32, 64, 128, 1, 4, 4), (32, 64, 128, 1, 2, 4),
    (32, 64, 256, 1, 4, 3), (32, 64, 256, 1, 4, 4), (32, 128, 256, 1, 4, 3), (32, 128, 256, 1, 8, 3),
    (32, 128, 128, 1, 4, 4), (32, 128, 128, 1, 4, 5), (32, 256, 128, 1, 8, 3), (32, 256, 128, 1, 4, 2),
    (32, 64, 512, 1, 4, 2), (32, 32, 512, 1, 4, 3), (64, 64, 256, 1, 4, 3), (64, 128, 256, 1, 8, 3),
    (64, 128, 128, 1, 4, 4))]
FP8_DOWN_CANDIDATES = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st, "SWAP_AB": False}
                       for n, k, w, st in ((128, 256, 4, 3), (128, 256, 8, 3), (64, 256, 4, 4), (256, 128, 8, 3),
                                           (128, 128, 4, 5), (64, 128, 4, 5), (32, 128, 2, 4), (256, 64, 4, 3))]
# The transposed product (SWAP_AB) where the weight tile can be the MMA's tall side and the row block is short.
CANDIDATES += tuple({**c, "SWAP_AB": True} for c in CANDIDATES if c["BLOCK_M"] < 64 and c["BLOCK_N"] >= 64)
# Then the down projection's own tiles, tried on the best row layout found (both GEMMs share it).
DOWN_CANDIDATES = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st, SWAP_AB=swap)
                   for n, k, w, st in ((32, 128, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3),
                                       (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 4), (256, 64, 8, 3),
                                       (32, 256, 4, 3), (64, 128, 8, 5))
                   for swap in (False, True) if not swap or n >= 64]


def previous_config(pairs: int, num_experts: int, *_, **__) -> dict:
    """The table this tree replaced: sorted blocks at every size, one tile for both dtypes and both GEMMs."""
    if pairs <= num_experts * 4:
        return _tiles(False, 16, 64, 128, 1, 4, 3)
    if pairs <= num_experts * 32:
        return _tiles(False, 32, 64, 64, 4, 4, 3)
    return _tiles(False, 64, 128, 64, 8, 4, 3)


def norm_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(out.float() - ref.float()) / torch.linalg.vector_norm(ref.float())).item()


def short(cfg: dict) -> str:
    text = ("pair " if cfg.get("PER_PAIR") else "sorted ") + "/".join(
        str(cfg.get(k)) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"))
    text += (" swapped" if cfg.get("SWAP_AB") else "") + (" fast-accum" if cfg.get("FAST_ACCUM") else "")
    down = cfg.get("DOWN") or {}
    shown = "/".join(str(down[k]) for k in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages") if k in down)
    return text + (" down " + shown + (" swapped" if down.get("SWAP_AB") else "")
                   + (" fast-accum" if down.get("FAST_ACCUM") else "") if down else "")


GEMM_CONFIG = "kvserve.ops.fused_moe._gemm_config"


def timed(paths: dict, call) -> tuple[float, torch.Tensor]:
    """(median ms of CUDA-graph replays, output) of call with the module attributes `paths` set."""
    restore = set_attributes(paths)
    try:
        out = call()
        return graph_time_ms(call, iters=10), out
    finally:
        set_attributes(restore)


def checked_time(paths: dict, call, ref, failures: list, label: str) -> float | None:
    """timed(), or None (with the reason in failures) where the call fails or its output strays from ref."""
    try:
        ms, out = timed(paths, call)
    except Exception as exc:  # noqa: BLE001 - a tile that does not fit, or a path not capturable here: go on
        failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:120]}")
        return None
    err = norm_rel_err(out, ref)
    if not err < 1e-2:
        failures.append(f"{label}: rel err {err:.4f}")
        return None
    return ms


def sweep_shape(label, experts, top_k, hidden, inter, tokens_list, rows, kinds=("bf16", "fp8_w8a8")):
    from kvserve.model.quantization.fp8_moe import _quantize_experts
    from kvserve.ops import fused_moe
    from kvserve.ops.fused_moe import fused_moe_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    q13, s13 = _quantize_experts(w13)
    q2, s2 = _quantize_experts(w2)
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
        logits = torch.randn(tokens, experts, device="cuda", generator=g)
        weights, ids = torch.topk(logits.softmax(-1), top_k)
        hit = int(torch.unique(ids).numel())
        pairs = tokens * top_k
        for kind, call in (("bf16", functools.partial(fused_moe_triton, x, w13, w2, weights, ids)),
                           ("fp8_w8a8", functools.partial(fused_moe_triton, x, q13, q2, weights, ids, s13, s2,
                                                          quantize_activations=True))):
            if kind not in kinds:
                continue
            weight_bytes = hit * 3 * hidden * inter * (2 if kind == "bf16" else 1)
            row = {"shape": label, "tokens": tokens, "kind": kind, "experts_hit": hit}
            row["previous_ms"], _ = timed({GEMM_CONFIG: previous_config}, call)
            row["current_ms"], ref = timed({}, call)
            row["current_config"] = short(fused_moe._gemm_config(pairs, experts, top_k, kind != "bf16"))
            best, failures = None, []

            def attempt(cfg):
                nonlocal best
                ms = checked_time({GEMM_CONFIG: lambda *_, **__: cfg}, call, ref, failures, short(cfg))
                if ms is not None and (best is None or ms < best[0]):
                    best = (ms, cfg)

            swap_ok = kind == "bf16"  # the transposed product takes 16-bit operands only (fused_moe._grouped_gemm)
            for cfg in CANDIDATES + (FP8_CANDIDATES if kind != "bf16" else []):
                if (not cfg["PER_PAIR"] or pairs <= 64) and (swap_ok or not cfg["SWAP_AB"]):
                    attempt(cfg)
            if best is not None:
                layout = best[1]
                for down in DOWN_CANDIDATES + (FP8_DOWN_CANDIDATES if kind != "bf16" else []):
                    if swap_ok or not down["SWAP_AB"]:
                        attempt({**layout, "DOWN": down})
            if best is not None and kind != "bf16":  # fp8: the whole K in the tensor cores' accumulator
                attempt({**best[1], "FAST_ACCUM": True, "DOWN": {**best[1]["DOWN"], "FAST_ACCUM": True}})
            row["best_ms"], row["best_config"] = (best[0], short(best[1])) if best else (None, None)
            row["best_tiles"] = best[1] if best else None
            # torch's grouped GEMM for the whole call; the parallel pair sort under the current tiles
            row["grouped_mm_ms"] = checked_time({"kvserve.ops.moe_grouped_mm.MIN_TOKENS": 1}, call, ref, failures,
                                                "torch grouped GEMM")
            row["parallel_sort_ms"] = checked_time({"kvserve.ops.moe_align.PARALLEL_ABOVE_PAIRS": 0}, call, ref,
                                                   failures, "parallel pair sort")
            row["failures"] = failures
            row["best_weight_GBps"] = round(weight_bytes / best[0] / 1e6, 1) if best else None
            rows.append(row)
            print("sweep", json.dumps(row), flush=True)


def table_from_sweep(path: str):
    """A stand-in for fused_moe._gemm_config from a sweep's JSON: where the current table's entry for a step
    (by shape and dtype) is the one a swept row ran as "current", that row's best; elsewhere the current entry.
    Set as kvserve.ops.fused_moe._gemm_config (benchmarks/gpu_moe.py --tiles-from) to run the engine on it."""
    from kvserve.ops import fused_moe

    current = fused_moe._gemm_config
    with open(path) as f:
        rows = json.load(f)["rows"]
    best = {(r["shape"], r["kind"] != "bf16", r["current_config"]): r["best_tiles"] for r in rows if r["best_tiles"]}
    shape_of = {(e, k): label for label, (e, k, *_) in SHAPES.items()}

    def swept(pairs: int, num_experts: int, top_k: int = 1, fp8: bool = False) -> dict:
        cfg = current(pairs, num_experts, top_k, fp8)
        return best.get((shape_of.get((num_experts, top_k)), fp8, short(cfg)), cfg)

    return swept


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="the Qwen3 shape only")
    ap.add_argument("--tokens", help=f"token counts, comma-separated (default: {','.join(map(str, TOKENS))})")
    ap.add_argument("--kinds", default="bf16,fp8_w8a8", help="bf16 and/or fp8_w8a8, comma-separated")
    args = ap.parse_args()
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else TOKENS
    rows = []
    for label, shape in SHAPES.items():
        if args.quick and label != "qwen3-30b-a3b":
            continue
        sweep_shape(label, *shape, tokens, rows, tuple(args.kinds.split(",")))
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "sweep_moe_tiles.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | tokens | kind | previous ms | current ms | best ms | best / previous | best / current "
          "| best GB/s | best config | torch grouped GEMM ms (/ current) | parallel sort ms (/ current) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["best_ms"]
        print(f"| {r['shape']} | {r['tokens']} | {r['kind']} | {r['previous_ms']:.4f} | {r['current_ms']:.4f} | "
              f"{b and round(b, 4)} | {b and round(b / r['previous_ms'], 3)} | {b and round(b / r['current_ms'], 3)} "
              f"| {r['best_weight_GBps']} | {r['best_config']} | "
              + " | ".join(f"{r[k]:.4f} ({r[k] / r['current_ms']:.3f})" if r[k] else "failed"
                           for k in ("grouped_mm_ms", "parallel_sort_ms")) + " |")


if __name__ == "__main__":
    main()
