"""Decode attention launch configurations on the GPU: the unified kernel's DECODE_CONFIG and split-KV
counts, timed on W1-like decode batches (GPU time from CUDA-graph replays; Llama-3.1-8B's heads, and
Qwen3-30B-A3B's 4 KV heads in the last column), each checked against the torch backend first.

    PYTHONUNBUFFERED=1 python benchmarks/sweep_decode_attention.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention_gpu import D, PEAK_TBPS, check, make_step  # noqa: E402
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


def time_us(backend, step) -> float:
    q, k, v, kv_cache, meta, *_ = step
    return 1e3 * triton.testing.do_bench_cudagraph(lambda: backend.forward(q, k, v, kv_cache, meta, D**-0.5))


def main() -> int:
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    steps = cases()
    variants = []
    for cfg in CONFIGS:
        b = TritonAttentionBackend(split_kv=False)
        b.DECODE_CONFIG = cfg
        variants.append((f"unified {cfg}", b))
    for n in SPLITS:
        variants.append((f"split-KV x{n}", TritonAttentionBackend(split_kv=True, num_splits=n)))
    variants.append(("default heuristic", TritonAttentionBackend()))
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
