"""Mixture of experts on the GPU, in one command:

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/gpu_moe.py --out $OUT [--num-requests 256]

1. kernel: the Triton fused-MoE (kvserve/ops/fused_moe.py) against the torch reference in fp32 on the same bf16
   inputs, for 1..8192 tokens, at Qwen3-30B-A3B's shape (128 experts, top-8, hidden 2048, expert width 768) and
   Mixtral-8x7B's (8 experts, top-2, hidden 4096, width 14336); bf16 experts, and fp8 experts both ways:
   weight-only ("fp8", W8A16) and W8A8 ("fp8_w8a8", activations quantized per row; its error against the W8A8
   reference, and against the fp32 weight-only reference: what quantizing the activations costs); time per call
   (CUDA graph replays, median) next to the torch reference in bf16 (one pair of GEMMs per expert hit) and the
   bytes of expert weights a call reads. From the two fp8 paths' times it prints the weight-only bound for
   `kvserve/model/quantization/fp8_moe.py`'s FP8_MOE_PATHS that the measurements favour. Tile configurations are
   timed by benchmarks/sweep_moe_tiles.py.
2. parity: a small random bf16 Qwen3-MoE, kvserve (Triton, CUDA graphs) vs HF transformers greedy on 8 prompts
   (where bf16 rounding splits them, the HF logit margin at the split), and graphs vs --enforce-eager.
3. engine: a Qwen3-30B-A3B-shaped model (48 layers, 32 heads, 4 KV heads, head_dim 128, 128 experts, 8 per
   token, width 768, vocabulary 151936) with dummy weights: W1 (docs/DESIGN.md) and batch-1 decode, in bf16
   and with --quantization fp8, output tokens/s. `--previous` runs each configuration a second time on the
   path this tree replaced, `--grouped-mm-min-tokens N` with steps of at least N tokens through torch's
   grouped GEMM (kvserve/ops/moe_grouped_mm.py): same-command ratios.
A table is printed last; everything goes to OUT/gpu_moe.json. Exit status 1 if a correctness check failed.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import time

import torch

from benchmarks.gpu_w1 import (add_w1_run_args, batch1_request, greedy, hf_bf16_reference, run_kvserve,
                               splits_against_hf, w1_requests, write_config)

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, torch_dtype="bfloat16", attention_bias=False, bos_token_id=151643,
    eos_token_id=151645,
)
SHAPES = {"qwen3-30b-a3b (E128 top8)": (128, 8, 2048, 768), "mixtral-8x7b (E8 top2)": (8, 2, 4096, 14336)}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
TOLERANCE = 2e-2  # max |triton - reference| / max |reference| for bf16 operands
# W8A8 against its own reference (the same quantized activations): only sums in another order differ, and
# with them now and then one e4m3 rounding of an activated element.
W8A8_TOLERANCE = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def fp8_moe_weight_only_bound(rows: list) -> dict:
    """The FP8_MOE_PATHS weight-only bound (steps of up to that many tokens weight-only, more W8A8) that these
    measurements favour: the one with the least time summed over the token counts, each shape's time relative
    to its faster path's so both shapes count alike; 0: W8A8 at every size."""
    candidates = [0] + sorted({r["tokens"] for r in rows})

    def cost(bound):
        return sum((r["fp8_ms"] if r["tokens"] <= bound else r["fp8_w8a8_ms"]) / min(r["fp8_ms"], r["fp8_w8a8_ms"])
                   for r in rows)

    best = min(candidates, key=cost)
    return {"weight_only_up_to_tokens": best, "relative_cost": round(cost(best) / len(rows), 4),
            "relative_cost_all_w8a8": round(cost(0) / len(rows), 4),
            "relative_cost_all_weight_only": round(cost(candidates[-1]) / len(rows), 4)}


def release():
    gc.collect()
    torch.cuda.empty_cache()


def graph_time_ms(fn, iters: int = 20, calls: int = 1) -> float:
    """Median time of one call, replayed from a CUDA graph (as the engine's decode steps run it); calls: how
    many calls one graph holds (for calls of a few microseconds, so the replay's own cost is spread)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


def eager_time_ms(fn, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / iters


# ---- 1. kernel ------------------------------------------------------------------------------------
def kernel(results: dict) -> bool:
    ok, rows = True, []
    for label, shape in SHAPES.items():
        ok &= kernel_shape(label, *shape, rows)
        release()
    results["kernel"] = rows
    return ok


def kernel_shape(label: str, experts: int, top_k: int, hidden: int, inter: int, rows: list) -> bool:
    from kvserve.model.quantization.fp8_moe import _quantize_experts
    from kvserve.ops import fused_moe, moe_align
    from kvserve.ops.fused_moe import fused_moe_torch, fused_moe_triton

    ok = True
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    q13, s13 = _quantize_experts(w13)
    q2, s2 = _quantize_experts(w2)
    w13_f32, w2_f32 = w13.float(), w2.float()
    expert_elements = 3 * hidden * inter
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
        logits = torch.randn(tokens, experts, device="cuda", generator=g)
        weights, ids = torch.topk(logits.softmax(-1), top_k)
        hit = int(torch.unique(ids).numel())
        row = {"shape": label, "tokens": tokens, "experts_hit": hit}
        fp8_weight_only_ref = None
        for kind, a, b, sa, sb, w8a8 in (("bf16", w13, w2, None, None, False), ("fp8", q13, q2, s13, s2, False),
                                         ("fp8_w8a8", q13, q2, s13, s2, True)):
            # fp32 reference on the same operands (fp8 weights dequantized in fp32); W8A8: the reference's W8A8
            # math on the bf16 x (gate_up rounded to bf16 where the kernel stores it)
            ref = fused_moe_torch(x if w8a8 else x.float(), w13_f32 if sa is None else a,
                                  w2_f32 if sb is None else b, weights, ids, sa, sb, quantize_activations=w8a8)
            out = fused_moe_triton(x, a, b, weights, ids, sa, sb, quantize_activations=w8a8)
            err = rel_err(out, ref)
            row[f"{kind}_rel_err"] = round(err, 5)
            ok &= err < (W8A8_TOLERANCE if w8a8 else TOLERANCE) and bool(torch.isfinite(out).all())
            if kind == "fp8":
                fp8_weight_only_ref = ref
            if w8a8:
                row["fp8_w8a8_err_vs_weight_only_ref"] = round(rel_err(out, fp8_weight_only_ref), 5)
            call = functools.partial(fused_moe_triton, x, a, b, weights, ids, sa, sb, quantize_activations=w8a8)
            ms = graph_time_ms(call)
            row[f"{kind}_ms"] = round(ms, 4)
            row[f"{kind}_weight_GBps"] = round(hit * expert_elements * (2 if sa is None else 1) / ms / 1e6, 1)
            del ref, out
        del fp8_weight_only_ref
        # The sort of pairs into expert blocks: one Triton launch vs the torch version (the reference).
        block_m = fused_moe._gemm_config(tokens * top_k, experts)["BLOCK_M"]
        row["align_triton_ms"] = round(graph_time_ms(
            functools.partial(moe_align.align_block_size_triton, ids, experts, block_m)), 4)
        try:
            row["align_torch_ms"] = round(graph_time_ms(functools.partial(moe_align.align_block_size, ids, experts,
                                                                          block_m)), 4)
        except RuntimeError as exc:  # a torch op that cannot be captured: say so, keep measuring
            row["align_torch_ms"] = f"not capturable ({str(exc)[:60]})"
        if tokens <= 2048:  # the per-expert loop syncs on the host: eager timing only
            row["torch_bf16_ms"] = round(eager_time_ms(functools.partial(fused_moe_torch, x, w13, w2, weights, ids)), 4)
        rows.append(row)
        print("kernel", json.dumps(row), flush=True)
    return ok


# ---- 2. parity ------------------------------------------------------------------------------------
def parity(results: dict) -> bool:
    import transformers

    from kvserve import LLM

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=32,
        num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False,
        initializer_range=0.05,
    )
    path, prompts, expected, margins = hf_bf16_reference(cfg, "kvserve-moe-parity-")
    n_new = len(expected[0])

    def run(**kw):
        llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3,
                  **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n_new), use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        llm.llm_engine.shutdown()
        del llm, outs
        release()
        return tokens

    graphs = run()
    eager = run(enforce_eager=True)
    chunked = run(max_num_batched_tokens=256)  # chunked prefill through the mixed-step graphs
    rows = splits_against_hf(prompts, expected, margins, graphs)
    results["parity"] = {"vs_hf": rows, "identical_vs_hf": sum(r["identical"] for r in rows),
                         "graphs_equal_eager": graphs == eager,
                         "chunked_identical_vs_hf": sum(a == b for a, b in zip(expected, chunked))}
    print("parity:", json.dumps(results["parity"]), flush=True)
    splits_are_ties = all(r["identical"] or r["hf_top2_logit_margin_at_split"] < 0.25 for r in rows)
    return graphs == eager and splits_are_ties


# ---- 3. engine ------------------------------------------------------------------------------------
def previous_paths() -> dict:
    """--previous: the path this tree replaced (the fused-MoE tile table before one-block-per-pair steps and
    per-dtype tiles: benchmarks/sweep_moe_tiles.py's previous_config), set for a second run of each engine
    configuration in the same command (a ratio against our own previous path)."""
    from benchmarks.sweep_moe_tiles import previous_config

    return {"kvserve.ops.fused_moe._gemm_config": previous_config}


def grouped_mm_paths(min_tokens: int) -> dict:
    """--grouped-mm-min-tokens: steps of at least that many tokens through torch's grouped GEMM
    (kvserve/ops/moe_grouped_mm.py), a second run of each configuration for a same-command ratio."""
    return {"kvserve.ops.moe_grouped_mm.MIN_TOKENS": min_tokens}


def swept_paths(path: str) -> dict:
    """--tiles-from: the fused-MoE tile table with each entry a sweep measured replaced by that row's best
    (benchmarks/sweep_moe_tiles.py's table_from_sweep), for a second run of each configuration in the same command."""
    from benchmarks.sweep_moe_tiles import table_from_sweep

    return {"kvserve.ops.fused_moe._gemm_config": table_from_sweep(path)}


def parallel_sort_paths(above_pairs: int) -> dict:
    """--parallel-sort-above: steps of more pairs than this sorted by the parallel pair sort
    (kvserve/ops/moe_align.py's PARALLEL_ABOVE_PAIRS; a negative number: only the steps one program cannot hold,
    more than ONE_PROGRAM_MAX_PAIRS), for a second run of each configuration."""
    from kvserve.ops import moe_align

    return {"kvserve.ops.moe_align.PARALLEL_ABOVE_PAIRS": above_pairs if above_pairs >= 0
            else moe_align.ONE_PROGRAM_MAX_PAIRS}


def variant_paths(args) -> list[tuple[str, dict]]:
    """The (label suffix, module attributes) of each variant asked for on the command line, besides --previous."""
    out = []
    if args.grouped_mm_min_tokens is not None:
        out.append(("grouped_mm", grouped_mm_paths(args.grouped_mm_min_tokens)))
    if args.tiles_from:
        out.append(("swept", swept_paths(args.tiles_from)))
    if args.parallel_sort_above is not None:
        out.append(("parallel_sort", parallel_sort_paths(args.parallel_sort_above)))
    return out


def zero_routers(model: torch.nn.Module) -> int:
    """Zero every MoE router's weights in place (CUDA graphs replay on the same memory): all logits 0, so the
    routing's ties send every token to the same top_k experts, as vLLM 0.26.0's fp8 dummy model
    routes (benchmarks/moe_routing_spread.py measured 8 distinct experts of 128 in every step and layer there).
    Returns how many routers were zeroed."""
    from kvserve.model.moe import SparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for block in blocks:
        block.gate.weight.data.zero_()
    return len(blocks)


def engine(results: dict, num_requests: int, quantization: str | None, args, variant: str = "",
           paths: dict | None = None, zero_router: bool = False, checkpoint: str | None = None) -> None:
    """variant: the label's suffix of a run with `paths` (module attributes) set, e.g. "previous";
    zero_router: the run routes as vLLM's fp8 dummy model does (zero_routers); checkpoint: the model read from
    this HF directory (benchmarks/write_random_checkpoint.py), labelled "checkpoint", instead of dummy weights."""
    from benchmarks.gpu_compare import set_attributes
    from kvserve import LLM

    label = ("checkpoint" if checkpoint else quantization or "bf16") + (f"_{variant}" if variant else "")
    restore = set_attributes(paths or {})
    path = checkpoint or write_config(QWEN3_30B_A3B)
    t = time.perf_counter()
    llm = LLM(path, load_format="auto" if checkpoint else "dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=4096, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              quantization=quantization)
    results[f"{label}_start_to_ready_s"] = round(time.perf_counter() - t, 1)
    results[f"{label}_weights_GiB"] = round(llm.llm_engine.executor.worker.weights_bytes / (1 << 30), 2)
    if zero_router:
        results[f"{label}_routers_zeroed"] = zero_routers(llm.llm_engine.executor.worker.runner.model)
    reqs = w1_requests()[:num_requests]
    run_kvserve(llm, [(p, 16) for p, _ in reqs[:8]], f"{label}_warmup", results)
    run_kvserve(llm, [batch1_request()], f"{label}_batch1", results)
    for i in range(args.passes):  # the best pass is the row; every pass's seconds show the spread
        run_kvserve(llm, reqs, f"{label}_w1_pass{i}", results)
    passes = [results.pop(f"{label}_w1_pass{i}") for i in range(args.passes)]
    results[f"{label}_w1"] = {**min(passes, key=lambda r: r["seconds"]), "passes_s": [r["seconds"] for r in passes]}
    llm.llm_engine.shutdown()
    del llm
    release()
    set_attributes(restore)


def load_vllm(directory: str | None) -> dict:
    """vLLM's results on the same shape and requests, by configuration; each checked to be the same workload."""
    out = {}
    for label in ("bf16", "fp8", "checkpoint"):
        path = os.path.join(directory or "", f"vllm_bench_moe_{label}.json")
        if directory and os.path.exists(path):
            with open(path) as f:
                res = json.load(f)
            assert res["shape"] == "qwen3-30b-a3b" and res["output_tokens"] == sum(o for _, o in w1_requests()), path
            out[label] = res
    return out


def main():
    ap = argparse.ArgumentParser()
    add_w1_run_args(ap)
    ap.add_argument("--passes", type=int, default=1, help="timed W1 passes per engine configuration, the best "
                    "one reported (as the bundle's vllm_bench.py --passes)")
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--configs", default="bf16,fp8", help="engine configurations to run, comma-separated (\"\": the --checkpoint run only)")
    ap.add_argument("--previous", action="store_true", help="also run each engine configuration on the previous "
                                                             "paths (previous_paths) for a same-command ratio")
    ap.add_argument("--grouped-mm-min-tokens", type=int, help="also run each engine configuration with steps of "
                    "at least this many tokens through torch's grouped GEMM (grouped_mm_paths)")
    ap.add_argument("--tiles-from", help="also run each engine configuration on the tile table of this "
                    "benchmarks/sweep_moe_tiles.py JSON (swept_paths)")
    ap.add_argument("--parallel-sort-above", type=int, help="also run each engine configuration with steps of "
                    "more pairs than this through the parallel pair sort (parallel_sort_paths; -1: only those one program "
                    "cannot hold)")
    ap.add_argument("--zero-router", action="store_true", help="also run each engine configuration with every "
                    "router zeroed (zero_routers): every token to the same top_k experts, as vLLM's fp8 dummy model "
                    "routes")
    ap.add_argument("--variants-only", action="store_true", help="run only the variants asked for (--previous, "
                    "--grouped-mm-min-tokens, --zero-router), not this tree's paths as they are")
    ap.add_argument("--checkpoint", help="also run the model of this HF directory (benchmarks/"
                    "write_random_checkpoint.py --shape qwen3-30b-a3b), labelled checkpoint; vLLM's run of it: "
                    "vllm_bench.py --shape qwen3-30b-a3b --extra '{\"model\": DIR, \"load_format\": \"auto\"}' "
                    "--tag _moe_checkpoint")
    ap.add_argument("--vllm-dir", help="where vLLM's runs of the same shape left vllm_bench_moe_bf16.json and "
                                       "vllm_bench_moe_fp8.json (the bundle's vllm_bench.py --shape qwen3-30b-a3b "
                                       "--tag _moe_bf16, and --extra '{\"quantization\": \"fp8\"}' --tag _moe_fp8)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    checks = {}
    if not args.skip_kernel:
        checks["kernel"] = kernel(results)
    if not args.skip_parity:
        checks["parity"] = parity(results)
    if not args.skip_engine:
        for quantization in [None if q == "bf16" else q for q in args.configs.split(",") if q]:
            if args.previous:
                engine(results, args.num_requests, quantization, args, "previous", previous_paths())
            if not args.variants_only:
                engine(results, args.num_requests, quantization, args)
            for variant, paths in variant_paths(args):
                engine(results, args.num_requests, quantization, args, variant, paths)
            if args.zero_router:
                engine(results, args.num_requests, quantization, args, "zero_router", zero_router=True)
        if args.checkpoint:
            engine(results, args.num_requests, None, args, checkpoint=args.checkpoint)
            for variant, paths in variant_paths(args):
                engine(results, args.num_requests, None, args, variant, paths, checkpoint=args.checkpoint)
    vllm = results["vllm"] = load_vllm(args.vllm_dir)
    with open(os.path.join(args.out, "gpu_moe.json"), "w") as f:
        json.dump(results, f, indent=1)

    print("\n| kernel: shape, tokens | bf16 ms (rel err) | fp8 weight-only ms (rel err) | fp8 W8A8 ms (rel err; vs "
          "weight-only ref) | W8A8 / weight-only time | torch ref bf16 ms | weights GB/s bf16/fp8/fp8 W8A8 "
          "| align ms triton / torch |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results.get("kernel", []):
        print(f"| {r['shape']}, {r['tokens']} | {r['bf16_ms']} ({r['bf16_rel_err']}) | {r['fp8_ms']} "
              f"({r['fp8_rel_err']}) | {r['fp8_w8a8_ms']} ({r['fp8_w8a8_rel_err']}; "
              f"{r['fp8_w8a8_err_vs_weight_only_ref']}) | {r['fp8_w8a8_ms'] / r['fp8_ms']:.2f}x | "
              f"{r.get('torch_bf16_ms', '-')} | {r['bf16_weight_GBps']} / {r['fp8_weight_GBps']} / "
              f"{r['fp8_w8a8_weight_GBps']} | {r['align_triton_ms']} / {r['align_torch_ms']} |")
    if results.get("kernel"):
        from kvserve.model.quantization.fp8_moe import FP8_MOE_PATHS

        bound = results["fp8_moe_paths"] = fp8_moe_weight_only_bound(results["kernel"])
        print(f"\nfp8 MoE paths: these times favour weight-only up to {bound['weight_only_up_to_tokens']} tokens, "
              f"W8A8 above (time relative to the faster path, mean: {bound['relative_cost']}; W8A8 everywhere "
              f"{bound['relative_cost_all_w8a8']}, weight-only everywhere {bound['relative_cost_all_weight_only']}). "
              f"Now: weight-only up to {next((p.max_tokens for p in FP8_MOE_PATHS if p.kernel == 'w8a16'), 0)} tokens.")
    if "parity" in results:
        p = results["parity"]
        print(f"\n| parity (small Qwen3-MoE, bf16) | identical vs HF {p['identical_vs_hf']}/8; splits at HF top-2 "
              f"margins {[r['hf_top2_logit_margin_at_split'] for r in p['vs_hf'] if not r['identical']]}; graphs == "
              f"eager {p['graphs_equal_eager']}; chunked identical {p['chunked_identical_vs_hf']}/8 |")
    print("\n| Qwen3-30B-A3B shape, dummy weights (checkpoint: --checkpoint's) | W1 output tok/s (s) | batch-1 tok/s "
          "| weights GiB | start (s) | vLLM W1 / batch-1 tok/s | kvserve / vLLM W1, batch-1 (target >= 1.00x) |")
    print("|---|---|---|---|---|---|---|")
    # A variant's run (zero_router, swept, ...) is compared with vLLM's run of its configuration.
    for label in ("bf16", "fp8", "checkpoint", "bf16_zero_router", "fp8_zero_router", "checkpoint_swept",
                  "checkpoint_parallel_sort"):
        if f"{label}_w1" in results:
            w, b = results[f"{label}_w1"], results[f"{label}_batch1"]
            v = vllm.get(label.split("_")[0])
            v_spread = f" (passes {v['passes_s']} s)" if v and len(v.get("passes_s", [])) > 1 else ""
            versus = (f"{v['vllm_offline_out_tok_per_s']}{v_spread} / {v['bs1_out_tok_per_s']} | "
                      f"{w['output_tok_s'] / v['vllm_offline_out_tok_per_s']:.2f}x, "
                      f"{b['output_tok_s'] / v['bs1_out_tok_per_s']:.2f}x" if v else "not run | -")
            spread = f", passes {w['passes_s']} s" if len(w.get("passes_s", [])) > 1 else ""
            print(f"| {label} | {w['output_tok_s']} ({w['seconds']}{spread}) | {b['output_tok_s']} | "
                  f"{results[f'{label}_weights_GiB']} | {results[f'{label}_start_to_ready_s']} | {versus} |")
    for label in ("bf16", "fp8", "checkpoint"):
        for variant, name in (("previous", "previous paths"), ("grouped_mm", "torch grouped GEMM"),
                              ("swept", "swept tiles"), ("parallel_sort", "parallel pair sort")):
            if f"{label}_{variant}_w1" not in results or f"{label}_w1" not in results:
                continue
            now, other = results[f"{label}_w1"], results[f"{label}_{variant}_w1"]
            now_b1, other_b1 = results[f"{label}_batch1"], results[f"{label}_{variant}_batch1"]
            print(f"| {label}, {name} (this command) | {other['output_tok_s']} | {other_b1['output_tok_s']} | | | "
                  f"this tree / {name}: W1 {now['output_tok_s'] / other['output_tok_s']:.3f}x, batch-1 "
                  f"{now_b1['output_tok_s'] / other_b1['output_tok_s']:.3f}x |")
    ok = all(checks.values())
    print(f"\ncorrectness: {'OK' if ok else 'FAILED'} {checks}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
