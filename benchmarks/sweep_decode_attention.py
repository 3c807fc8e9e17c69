"""Decode attention launch configurations on the GPU: the unified kernel's DECODE_CONFIG and split-KV
counts, timed on W1-like decode batches (GPU time from CUDA-graph replays; Llama-3.1-8B's heads, and
Qwen3-30B-A3B's 4 KV heads in the last column), each checked against the torch backend first.

    PYTHONUNBUFFERED=1 python benchmarks/sweep_decode_attention.py [--gemma [--out DIR]] [--variants JSON]

`--gemma`: W2's decode instead (Gemma-3-12B's heads, 16 over 8 of width 256; W2's contexts of 6,000-15,000
tokens; a global layer and a 1,024-token windowed one) over the wide-head configurations, unified and split-KV;
writes DIR/decode_attention_gemma.json with the fastest variant as TritonAttentionBackend attributes (the form
benchmarks/gpu_w2_gemma.py --attention-overrides reads).

`--variants '[{"WIDE_HEAD_SPLIT_CONFIG": [16, 64, 4, 3]}, ...]'`: time the defaults against these
TritonAttentionBackend attribute sets only, instead of the built-in grid (either mode).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention_gpu import PEAK_TBPS, check, make_step  # noqa: E402
from kvserve.ops.triton_attention import TritonAttentionBackend  # noqa: E402

# (BLOCK_M, TILE_N, num_warps, num_stages); the first is the current default.
CONFIGS = [TritonAttentionBackend.DECODE_CONFIG, (16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 8, 3),
           (16, 64, 2, 4), (16, 32, 4, 4), (16, 256, 8, 2), (16, 128, 4, 2), (16, 64, 4, 2)]
SPLITS = [2, 4]


def cases():
    rnd = random.Random(0)
    return [
        ("B=256 ctx U(100,1024)", make_step([rnd.randint(100, 1024) for _ in range(256)], [1] * 256, seed=1)),
        ("B=128 ctx U(400,1600)", make_step([rnd.randint(400, 1600) for _ in range(128)], [1] * 128, seed=2)),
        ("B=32 ctx U(800,2000)", make_step([rnd.randint(800, 2000) for _ in range(32)], [1] * 32, seed=3)),
        # Qwen3-30B-A3B's attention (32 query heads over 4 KV heads: a GQA group of 8), W1's decode batch
        ("MoE B=256 ctx U(100,1024)", make_step([rnd.randint(100, 1024) for _ in range(256)], [1] * 256, seed=4,
                                                kv_heads=4)),
    ]


def time_us(backend, step, window=None) -> float:
    q, k, v, kv_cache, meta, *_ = step
    scale = q.shape[-1] ** -0.5
    return 1e3 * triton.testing.do_bench_cudagraph(
        lambda: backend.forward(q, k, v, kv_cache, meta, scale, sliding_window=window))


GEMMA_WINDOW = 1024
GEMMA_UNIFIED = [(16, 128, 4, 3), (16, 64, 4, 3), (16, 64, 4, 2), (16, 32, 4, 3),
                 (16, 64, 8, 3), (16, 128, 8, 2), (16, 32, 4, 4), (16, 64, 2, 3)]
GEMMA_SPLIT = [(16, 128, 4, 3), (16, 64, 4, 3), (16, 32, 4, 3)]


def backend_with(attrs: dict) -> TritonAttentionBackend:
    """A backend with these attributes set over the class's defaults."""
    backend = TritonAttentionBackend()
    for name, value in attrs.items():
        setattr(backend, name, value)
    return backend


def gemma_sweep(out_dir: str, only: list[dict] | None = None) -> int:
    """The defaults and each variant (the attributes it sets), timed on a global and a windowed layer of W2's full
    decode batch and of a late one (24 requests); the fastest by the sum over W2's 8 global and 40 windowed layers."""
    import json
    import os

    from kvserve.bench.datasets import W2_MAX_MODEL_LEN

    rnd = random.Random(5)
    shape = {"heads": 16, "kv_heads": 8, "head_dim": 256}
    full = [rnd.randint(6000, 15000) for _ in range(64)]
    late = [rnd.randint(6000, 15000) + 300 for _ in range(24)]
    steps = {
        "B=64 global": (make_step(full, [1] * 64, seed=6, **shape), None),
        "B=64 window": (make_step(full, [1] * 64, seed=6, window=GEMMA_WINDOW, **shape), GEMMA_WINDOW),
        "B=24 global": (make_step(late, [1] * 24, seed=7, **shape), None),
        "B=24 window": (make_step(late, [1] * 24, seed=7, window=GEMMA_WINDOW, **shape), GEMMA_WINDOW),
    }
    variants = [{}]  # the class's defaults
    if only is not None:
        variants += only
    else:
        variants += [{"WIDE_HEAD_DECODE_CONFIG": cfg, "WIDE_HEAD_LONG_CONTEXT_KEYS_PER_SPLIT": None}
                     for cfg in GEMMA_UNIFIED]
        variants += [{"WIDE_HEAD_SPLIT_CONFIG": cfg, "WIDE_HEAD_LONG_CONTEXT_KEYS_PER_SPLIT": keys}
                     for cfg in GEMMA_SPLIT for keys in (W2_MAX_MODEL_LEN // 2, W2_MAX_MODEL_LEN // 4,
                                                         W2_MAX_MODEL_LEN // 8)]
    print(f"{'variant':<88}" + "".join(f"{name:>26}" for name in steps) + f"{'W2 step est. ms':>17}")
    rows = []
    for attrs in variants:
        backend = backend_with(attrs)
        splits = backend.choose_num_splits(64, 8, 1, W2_MAX_MODEL_LEN, 256)  # as the engine does: max_model_len
        backend.forced_num_splits = splits if splits > 1 else None
        backend.split_kv = splits > 1
        label = (", ".join(f"{k}={v}" for k, v in attrs.items()) or "defaults") + f" ({splits} splits)"
        if not all(check(f"{name}", backend, step, window) for name, (step, window) in steps.items()
                   if name.startswith("B=24")):
            print(f"{label}: CORRECTNESS FAILED")
            continue
        cells, us = [], {}
        for name, (step, window) in steps.items():
            us[name] = time_us(backend, step, window)
            cells.append(f"{us[name]:8.1f} us {step[5] / (us[name] * 1e-6) / 1e12:4.2f} TB/s")
        est = (8 * us["B=64 global"] + 40 * us["B=64 window"]) / 1e3
        rows.append((est, attrs, label, us))
        print(f"{label:<88}" + "".join(f"{c:>26}" for c in cells) + f"{est:17.2f}", flush=True)
    rows.sort(key=lambda r: r[0])
    best, current = rows[0], next(r for r in rows if r[1] == {})
    print(f"fastest: {best[2]}: {best[0]:.2f} ms of attention a full W2 decode step, current {current[0]:.2f} ms "
          f"({current[0] / best[0]:.2f}x); copy ceiling {PEAK_TBPS} TB/s")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode_attention_gemma.json"), "w") as f:
        json.dump({"best": best[1], "best_ms": best[0], "current_ms": current[0],
                   "rows": [{"variant": r[2], "us": r[3], "w2_step_ms": r[0]} for r in rows]}, f, indent=1)
    return 0


def main() -> int:
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", type=json.loads, default=None,
                    help="a JSON list of TritonAttentionBackend attribute sets to time against the defaults")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if args.gemma:
        return gemma_sweep(args.out, args.variants)
    steps = cases()
    variants = []
    if args.variants is None:
        for cfg in CONFIGS:
            b = TritonAttentionBackend(split_kv=False)
            b.DECODE_CONFIG = cfg
            variants.append((f"unified {cfg}", b))
        for n in SPLITS:
            variants.append((f"split-KV x{n}", TritonAttentionBackend(split_kv=True, num_splits=n)))
    variants.append(("default heuristic", TritonAttentionBackend()))
    for attrs in args.variants or []:
        variants.append((", ".join(f"{k}={v}" for k, v in attrs.items()), backend_with(attrs)))
    print(f"{'variant':<32}" + "".join(f"{name:>24}" for name, _ in steps))
    for vname, backend in variants:
        ok = all(check(f"{vname} {name}", backend, step) for name, step in (steps[0], steps[-1]))  # both shapes
        if not ok:
            print(f"{vname}: CORRECTNESS FAILED")
            continue
        cells = []
        for _, step in steps:
            us = time_us(backend, step)
            cells.append(f"{us:8.1f} us {step[5] / (us * 1e-6) / 1e12:4.2f} TB/s")
        print(f"{vname:<32}" + "".join(f"{c:>24}" for c in cells), flush=True)
    print(f"(copy ceiling {PEAK_TBPS} TB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
