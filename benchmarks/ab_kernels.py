"""Old against new kernels on the GPU, each checked against the other before it is timed; a table last.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/ab_kernels.py [--only fp8-fusion,prefill] [--out DIR]

* fp8-fusion: the W8A8 inputs of Llama-3.1-8B's layer (hidden 4096 after RMSNorm, intermediate 14336 after
  SiLU*mul) at M = 32 .. 16,384 rows: the 16-bit kernel + fp8_quant.quantize_per_token (before) against
  rms_norm_fp8 / silu_and_mul_fp8 (now); their outputs must be the same bytes.
* prefill: the unified attention kernel on long prompts (the 8k TTFT and W2 shapes: 32 query heads, 8 KV
  heads, head_dim 128, bf16, one prompt of 8,192 tokens in chunks of 8,192 or 16,384 and a 2,048-token chunk
  on 6,144 cached tokens) for a grid of launch configurations; each must match the one the backend picks
  now within bf16 rounding. Prints TFLOP/s (causal: half the QK^T and PV products).

Timing: triton.testing.do_bench (median of many runs, L2 flushed between them), in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3  # ms -> us


def fp8_fusion(rows_out: list) -> None:
    from kvserve.ops import fp8_quant, fused_kernels

    torch.manual_seed(0)
    hidden, inter = 4096, 14336
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    for m in (32, 256, 2048, 8192, 16384):
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        gate_up = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)

        def norm_before():
            y, res = fused_kernels.rms_norm(x, w, 1e-5, r)
            return fp8_quant.quantize_per_token(y), res

        def norm_now():
            a, res = fused_kernels.rms_norm_fp8(x, w, 1e-5, r)
            return (a.q, a.scale), res

        def silu_before():
            return fp8_quant.quantize_per_token(fused_kernels.silu_and_mul(gate_up))

        def silu_now():
            a = fused_kernels.silu_and_mul_fp8(gate_up)
            return a.q, a.scale

        (bq, bs), bres = norm_before()
        (nq, ns), nres = norm_now()
        same = torch.equal(bq.view(torch.uint8), nq.view(torch.uint8)) and torch.equal(bs, ns) and torch.equal(bres, nres)
        rows_out.append({"section": "fp8-fusion", "case": f"RMSNorm+residual -> fp8, M={m}", "same_output": same,
                         "before_us": round(bench(norm_before), 1), "now_us": round(bench(norm_now), 1)})
        bq, bs = silu_before()
        nq, ns = silu_now()
        same = torch.equal(bq.view(torch.uint8), nq.view(torch.uint8)) and torch.equal(bs, ns)
        rows_out.append({"section": "fp8-fusion", "case": f"SiLU*mul -> fp8, M={m}", "same_output": same,
                         "before_us": round(bench(silu_before), 1), "now_us": round(bench(silu_now), 1)})
        print(json.dumps(rows_out[-2:]), flush=True)


def _prefill_batch(ctx: int, q_len: int, block_size: int = 16):
    """One request: q_len new tokens after ctx cached ones, Llama-3.1-8B attention shape, bf16, paged."""
    from kvserve.ops.attention_metadata import AttentionMetadata

    h, hkv, d = 32, 8, 128
    seq = ctx + q_len
    nb = -(-seq // block_size)
    g = torch.Generator(device="cuda").manual_seed(seq)
    table = torch.randperm(nb + 8, device="cuda", generator=g)[:nb].to(torch.int32)[None]
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    seq_t = torch.tensor([seq], dtype=torch.int32, device="cuda")
    slots = (table[0, torch.arange(ctx, seq, device="cuda") // block_size].long() * block_size
             + torch.arange(ctx, seq, device="cuda") % block_size)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_t, block_tables=table,
                             max_query_len=q_len, max_seq_len=seq, num_actual_tokens=q_len, block_size=block_size,
                             query_start_loc_cpu=qsl.cpu(), seq_lens_cpu=seq_t.cpu())
    q = torch.randn(q_len, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(q_len, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(q_len, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cache = torch.randn(2, nb + 8, block_size, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, cache, meta


# (BLOCK_M, TILE_N, num_warps, num_stages) candidates; None: what the backend picks for that query length now
# (launch_config: PREFILL_CONFIG, or LONG_PREFILL_CONFIG from LONG_PREFILL_MIN_QUERY tokens).
PREFILL_CONFIGS = [None, (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 2),
                   (128, 64, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)]


def prefill(rows_out: list) -> None:
    from kvserve.ops.triton_attention import TritonAttentionBackend

    for ctx, q_len in ((0, 8192), (0, 16384), (6144, 2048)):
        current = TritonAttentionBackend().launch_config(q_len)
        q, k, v, cache, meta = _prefill_batch(ctx, q_len)
        scale = 128 ** -0.5
        # causal FLOPs: 2 GEMMs x 2 flops x heads x d x (keys each query sees)
        keys_seen = sum(ctx + i + 1 for i in range(q_len))
        flops = 4 * 32 * 128 * keys_seen
        reference = None
        for config in PREFILL_CONFIGS:
            backend = TritonAttentionBackend()
            backend.PREFILL_CONFIG = backend.LONG_PREFILL_CONFIG = config or current
            run = lambda: backend.forward(q, k, v, cache, meta, scale)
            try:
                out = run().float()
            except Exception as exc:  # a configuration that does not fit (shared memory) is reported, not fatal
                rows_out.append({"section": "prefill", "case": f"ctx {ctx} + {q_len}", "config": str(config),
                                 "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            if reference is None:
                reference = out
            err = (out - reference).abs().max().item()
            us = bench(run)
            rows_out.append({"section": "prefill", "case": f"ctx {ctx} + {q_len}",
                             "config": f"{config or current}{' (current)' if config is None else ''}",
                             "max_abs_diff_vs_current": round(err, 4), "us": round(us, 1),
                             "tflops": round(flops / us / 1e6, 1)})
            print(json.dumps(rows_out[-1]), flush=True)


SECTIONS = {"fp8-fusion": fp8_fusion, "prefill": prefill}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows: list[dict] = []
    for name in args.only.split(","):
        SECTIONS[name](rows)
    with open(os.path.join(args.out, "ab_kernels.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| case | before (us) | now (us) | now / before | same output |\n|---|---|---|---|---|")
    for r in rows:
        if r["section"] == "fp8-fusion":
            print(f"| {r['case']} | {r['before_us']} | {r['now_us']} | {r['now_us'] / r['before_us']:.2f} | "
                  f"{r['same_output']} |")
    print("\n| prefill case | config (BLOCK_M, TILE_N, warps, stages) | us | TFLOP/s | max diff vs current |\n"
          "|---|---|---|---|---|")
    for r in rows:
        if r["section"] == "prefill":
            if "error" in r:
                print(f"| {r['case']} | {r['config']} | failed: {r['error']} | | |")
            else:
                print(f"| {r['case']} | {r['config']} | {r['us']} | {r['tflops']} | {r['max_abs_diff_vs_current']} |")
    bad = [r for r in rows if r.get("same_output") is False or r.get("max_abs_diff_vs_current", 0) > 0.05]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
