"""AWQ-int4 linear layers on the GPU: bf16 F.linear vs the dispatch of int_matmul.py (split-K skinny kernel
for M <= 16, dequantize + cuBLAS above), on Llama-3.1-8B's linear shapes, group 128, bf16 activations.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/sweep_int4_linear.py [--out $OUT]

Per (shape, M): correctness against the reference (torch dequantize, then a bf16
matmul), then GPU time of each from CUDA-graph replays (triton.testing.do_bench_cudagraph). One replay
runs the layer over several copies of its weights, as consecutive layers do, so the weights come
from HBM and not from the 50 MB L2. Effective TB/s = packed weight + scales + zeros bytes (bf16:
weight bytes) / time, the figure that matters at small M. For M <= 16 a few skinny launch configs and
split counts are tried too, so the threshold and configs of int_matmul.py can be moved; the engine uses
only the fixed rule.
Errors are caught per row. JSON to OUT/sweep_int4_linear.json; a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F
import triton

from kvserve.model.quantization import int_matmul as rule
from kvserve.model.quantization.int_weights import unpack_rows
from kvserve.ops.triton_int_gemv import skinny_int_gemm

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
MS = [1, 4, 16, 64, 256, 2048, 8192]
GROUP, BITS = 128, 4
L2_DEFEAT_BYTES = 256 << 20  # weight bytes each replay streams, in copies of the layer
# Skinny (BLOCK_N, BLOCK_K, num_warps, num_stages) tried besides the rule's, each at split counts 1, the
# rule's for that config, and twice that.
M1_CONFIGS = [(128, 128, 4, 3), (256, 64, 8, 3), (128, 256, 8, 2)]
DOT_CONFIGS = [(64, 128, 4, 3), (128, 128, 8, 3)]
DEVICE = "cuda"


def make_layer(k: int, n: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(k * 7 + n)
    return {
        "qweight": torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=device, generator=g),
        "scales": (torch.rand(k // GROUP, n, device=device, generator=g) * 0.01 + 0.001).to(torch.bfloat16),
        "zeros": torch.randint(0, 16, (k // GROUP, n), device=device, generator=g).to(torch.bfloat16),
    }


def reference_weight(layer: dict) -> torch.Tensor:
    """W [K, N] bf16 by torch ops: (q - z) * s in fp32, as IntWeights.dequantize."""
    q = unpack_rows(layer["qweight"], BITS)
    k, n = q.shape
    q = q.view(k // GROUP, GROUP, n).float()
    w = (q - layer["zeros"].float()[:, None]) * layer["scales"].float()[:, None]
    return w.reshape(k, n).to(torch.bfloat16)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()


def bench_us(fn, copies: int) -> float:
    def run():
        for i in range(copies):
            fn(i)
    return 1e3 * triton.testing.do_bench_cudagraph(run, rep=15) / copies


def int_args(layer: dict):
    return layer["qweight"], layer["scales"], layer["zeros"], None, BITS, GROUP


def skinny_variants(x, ref, layers, copies, dev) -> dict:
    m, k = x.shape
    n = layers[0]["qweight"].shape[1]
    variants = {}
    for cfg in (M1_CONFIGS if m == 1 else DOT_CONFIGS):
        split0 = rule.skinny_split_k(n, k, dev, cfg, m)
        for split in sorted({1, split0, split0 * 2}):
            name = f"skinny{cfg} split{split}"
            try:
                def run(i, split=split, cfg=cfg):
                    return skinny_int_gemm(x, *int_args(layers[i]), split, cfg)
                variants[name] = {"err": rel_err(run(0), ref), "us": bench_us(run, copies)}
            except Exception as exc:  # noqa: BLE001 - a config that fails is reported, the others still run
                variants[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return variants


def measure(m: int, k: int, n: int, layers, w_nk, w_ref, copies: int, bf16_copies: int, int_bytes: int, dev) -> dict:
    row = {"M": m}
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ref = x @ w_ref

    def new(i):
        return rule.int_matmul(x, *int_args(layers[i]))

    row["err_new"] = rel_err(new(0), ref)
    row["bf16_us"] = bench_us(lambda i: F.linear(x, w_nk[i]), bf16_copies)
    row["new_us"] = bench_us(new, copies)
    row["bf16_TBps"] = k * n * 2 / row["bf16_us"] / 1e6
    row["new_TBps"] = int_bytes / row["new_us"] / 1e6
    if m > rule.SKINNY_MAX_M:
        return row  # dequantize + cuBLAS: nothing to choose
    row["rule_split"] = rule.skinny_split_k(n, k, dev, rule.skinny_config(m, BITS), m)
    variants = skinny_variants(x, ref, layers, copies, dev)
    ok = {name: v for name, v in variants.items() if "us" in v and v["err"] < 2e-2}
    if ok:
        best = min(ok, key=lambda name: ok[name]["us"])
        row["best_variant"], row["best_us"] = best, ok[best]["us"]
    row["variants"] = variants
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    args = ap.parse_args()
    dev = torch.device(DEVICE)
    t_start = time.perf_counter()
    results = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else str(dev),
               "torch": torch.__version__, "triton": triton.__version__,
               "rule": {"SKINNY_MAX_M": rule.SKINNY_MAX_M,
                        "SKINNY_M1_CONFIG": rule.SKINNY_M1_CONFIG, "SKINNY_DOT_CONFIG": rule.SKINNY_DOT_CONFIG,
                        "PROGRAMS_PER_SM": rule.PROGRAMS_PER_SM,
                        "PROGRAMS_PER_SM_M1": rule.PROGRAMS_PER_SM_M1, "MIN_K_TILES": rule.MIN_K_TILES},
               "rows": []}
    print(f"{results['device']}  torch {torch.__version__}  triton {triton.__version__}  rule {results['rule']}")
    for sname in args.shapes.split(","):
        try:
            k, n = SHAPES[sname]
            int_bytes = k * n // 2 + 2 * (k // GROUP) * n * 2
            copies = max(2, min(16, -(-L2_DEFEAT_BYTES // int_bytes)))
            layers = [make_layer(k, n, dev) for _ in range(copies)]
            w_ref = reference_weight(layers[0])
            bf16_copies = max(2, min(8, -(-L2_DEFEAT_BYTES // (k * n * 2))))
            w_nk = [w_ref.t().contiguous()] + [torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                                               for _ in range(bf16_copies - 1)]
        except Exception as exc:  # noqa: BLE001 - a shape that cannot even be set up must not stop the others
            print(f"{sname}: setup failed: {exc}")
            results["rows"].append({"shape": sname, "error": f"setup: {type(exc).__name__}: {exc}"[:300]})
            continue
        for m in [int(v) for v in args.ms.split(",")]:
            try:
                row = measure(m, k, n, layers, w_nk, w_ref, copies, bf16_copies, int_bytes, dev)
            except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
                traceback.print_exc()
                row = {"M": m, "error": f"{type(exc).__name__}: {exc}"[:300]}
            row = {"shape": sname, "K": k, "N": n, **row}
            results["rows"].append(row)
            print(json.dumps({key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()
                              if key != "variants"}), flush=True)
        layers = w_nk = w_ref = None
        torch.cuda.empty_cache()
    results["wall_s"] = round(time.perf_counter() - t_start, 1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep_int4_linear.json"), "w") as f:
        json.dump(results, f, indent=1)

    print(f"\n{results['device']}, AWQ int4 group {GROUP}, bf16 activations; time per layer (CUDA graphs, "
          f"weights from HBM); wall {results['wall_s']} s")
    print("| layer | M | bf16 us | int4 us | int4 vs bf16 | bf16 TB/s | int4 TB/s | err | best decode variant (us) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        if "error" in r:
            print(f"| {r['shape']} | {r.get('M', '')} | FAILED: {r['error'][:150]} | | | | | | |")
            continue
        print(f"| {r['shape']} {r['K']}->{r['N']} | {r['M']} | {r['bf16_us']:.1f} | {r['new_us']:.1f} | "
              f"{r['bf16_us'] / r['new_us']:.2f}x | {r['bf16_TBps']:.2f} | {r['new_TBps']:.2f} | "
              f"{r['err_new']:.1e} | {r.get('best_variant', '-')} ({r.get('best_us', 0):.1f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
