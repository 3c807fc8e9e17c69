"""Triton paged attention on the GPU: correctness against the torch backend, then timings.

Llama-3.1-8B attention shapes (H=32, Hkv=8, D=128), block size 16, bf16. Cases:
  (a) decode, batch 256, contexts uniform in 100..2000
  (b) decode, batch 4, context 2048: split-KV (the default choice) and the plain unified kernel
  (c) prefill, 8 prompts of 512 tokens
Each case first checks the triton backend's output and written cache against TorchAttentionBackend, then
times backend.forward (cache write + attention) with triton.testing.do_bench, eagerly (host launch
overhead included: ~3 kernel launches) and replayed from a CUDA graph (do_bench_cudagraph: GPU time).
The bandwidth columns are bytes of K and V in the requests' contexts (each read once) / graph time,
next to the 4.27 TB/s peak; TFLOP/s counts the causal QK^T and PV products (4 * D flops per visible
query-key pair per head).

Usage: python benchmarks/bench_attention_gpu.py   (exit status 1 if a correctness check fails)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when kvserve is not pip-installed

from kvserve.ops.attention_metadata import AttentionMetadata
from kvserve.ops.torch_attention import TorchAttentionBackend
from kvserve.ops.triton_attention import TritonAttentionBackend

H, HKV, D, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
PEAK_TBPS = 4.27
ATOL, RTOL = 2e-2, 2e-2  # bf16 output; P is rounded to bf16 before the PV product


def make_step(ctx_lens, q_lens, seed=0, kv_heads=HKV, heads=H, head_dim=D, window=None):
    """One step's q/k/v, a paged cache with random contents and shuffled block tables, and its metadata;
    `heads` query heads over kv_heads KV heads (Llama-3.1-8B's 32 over 8 by default; Qwen3-30B-A3B has 4 KV
    heads, Gemma-3-12B 16 over 8 of width 256). `window`: the KV bytes count only the keys a windowed layer
    reads (pass the same window to the backend)."""
    rnd = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    nblocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(nblocks) + 1
    ids = list(range(1, num_blocks))
    rnd.shuffle(ids)
    tables = torch.zeros(len(seq_lens), max(nblocks), dtype=torch.int32)
    for i, n in enumerate(nblocks):
        tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    slots = [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for i, (c, s) in enumerate(zip(ctx_lens, seq_lens)) for p in range(c, s)]
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
        query_start_loc=qsl.cuda(),
        seq_lens=seq_t.cuda(),
        block_tables=tables.cuda(),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_actual_tokens=len(slots),
        block_size=BLOCK_SIZE,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_t,
    )
    t = len(slots)
    q = torch.randn(t, heads, head_dim, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(t, kv_heads, head_dim, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(t, kv_heads, head_dim, device="cuda", dtype=DTYPE, generator=gen)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device="cuda", dtype=DTYPE, generator=gen)
    keys_read = sum(min(s, window) if window else s for s in seq_lens)
    kv_bytes = keys_read * kv_heads * head_dim * 2 * kv_cache.element_size()
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in zip(ctx_lens, q_lens))  # visible (query, key) pairs
    return q, k, v, kv_cache, meta, kv_bytes, 4 * head_dim * heads * pairs


def check(name, backend, step, window=None) -> bool:
    q, k, v, kv_cache, meta, *_ = step
    scale = q.shape[-1] ** -0.5
    ref_cache, tri_cache = kv_cache.clone(), kv_cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, scale, sliding_window=window)
    out = backend.forward(q, k, v, tri_cache, meta, scale, sliding_window=window)
    torch.cuda.synchronize()
    err = (out.float() - ref.float()).abs().max().item()
    ok = torch.equal(tri_cache, ref_cache) and torch.allclose(out.float(), ref.float(), atol=ATOL, rtol=RTOL)
    print(f"check {name:<34} max |triton - torch| = {err:.2e}  cache equal = {torch.equal(tri_cache, ref_cache)}"
          f"  {'OK' if ok else 'FAIL'}")
    return ok


def bench(backend, step) -> tuple[float, float]:
    """(eager, CUDA-graph) milliseconds per forward."""
    q, k, v, kv_cache, meta, *_ = step

    def fn():
        return backend.forward(q, k, v, kv_cache, meta, D**-0.5)

    return triton.testing.do_bench(fn), triton.testing.do_bench_cudagraph(fn)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    rnd = random.Random(0)
    auto = TritonAttentionBackend()  # split-KV chosen by the heuristic
    step_b = make_step([2047] * 4, [1] * 4, seed=2)
    cases = [
        ("(a) decode B=256 ctx U(100,2000)", auto,
         make_step([rnd.randint(100, 2000) - 1 for _ in range(256)], [1] * 256, seed=1)),
        ("(b) decode B=4 ctx 2048 split-KV", auto, step_b),
        ("(b) decode B=4 ctx 2048 no split", TritonAttentionBackend(split_kv=False), step_b),
        ("(c) prefill 8 x 512", auto, make_step([0] * 8, [512] * 8, seed=3)),
    ]
    splits = auto.choose_num_splits(4, HKV, 1, step_b[4].max_seq_len)
    print(f"(b): the default backend picks {splits} splits")
    if splits < 2:
        print("(b) was meant to take the split-KV path")
        return 1

    ok = True
    for name, backend, step in cases:
        ok &= check(name, backend, step)
    # Mixed batch (prefill chunk on a cached prefix + decodes), correctness only.
    ok &= check("mixed: chunk on prefix + decodes", auto, make_step([700, 33, 1500, 0], [300, 1, 1, 77], seed=4))
    if not ok:
        print("CORRECTNESS CHECK FAILED")
        return 1

    print(f"\n{'case':<34} {'eager us':>9} {'graph us':>9} {'KV MB':>7} {'TB/s':>6} {'of ' + str(PEAK_TBPS):>8}"
          f" {'TFLOP/s':>8}")
    for name, backend, step in cases:
        eager_ms, graph_ms = bench(backend, step)
        kv_bytes, flops = step[5], step[6]
        tbps = kv_bytes / (graph_ms * 1e-3) / 1e12
        print(f"{name:<34} {eager_ms * 1e3:>9.1f} {graph_ms * 1e3:>9.1f} {kv_bytes / 1e6:>7.1f} {tbps:>6.2f}"
              f" {100 * tbps / PEAK_TBPS:>7.0f}% {flops / (graph_ms * 1e-3) / 1e12:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
