"""Old against new kernels on the GPU, each checked against the other before it is timed; a table last.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/ab_kernels.py [--only int4,fp8,fp8-fusion,prefill,prefill-w2]
        [--sweep] [--out DIR] [--prefill-shapes gemma,llama] [--prefill-configs JSON]
        [--vllm-fa]

* fp8-fusion: the W8A8 inputs of Llama-3.1-8B's layer (hidden 4096 after RMSNorm, intermediate 14336 after
  SiLU*mul) at M = 32 .. 16,384 rows: the 16-bit kernel + fp8_quant.quantize_per_token (before) against
  rms_norm_fp8 / silu_and_mul_fp8 (now); their outputs must be the same bytes.
* prefill: the unified attention kernel on long prompts (the 8k TTFT and W2 shapes: 32 query heads, 8 KV
  heads, head_dim 128, bf16, one prompt of 8,192 tokens in chunks of 8,192 or 16,384 and a 2,048-token chunk
  on 6,144 cached tokens; and Gemma-3-12B's, 16 query heads, 8 KV heads, head_dim 256, its global layers and
  its local ones with a 1,024-token window) for a grid of launch configurations; each must match the one the
  backend picks now within bf16 rounding. Prints TFLOP/s (causal: half the QK^T and PV products; windowed:
  the keys each query sees).

* prefill-w2: Gemma-3-12B's attention (a global layer, a local one) in W2's real prefill steps: a 16,384-token
  chunk of two or three prompts beside the decodes of the prompts already done (w2_steps). The backend as it is,
  with its long-prefill steps' decodes in the unified kernel instead (MIXED_STEP_DECODE_KERNEL off), and with
  `--vllm-fa` vLLM's FlashAttention 3 on the same cache, with `--prefill-configs` each launch configuration (the
  JSON list's nulls skipped: the current one is always timed); then the sum over a step's 8 global and 40 local
  layers.
* int4: AWQ-int4 layers (group 128, bf16) of Llama-3.1-8B's four linear shapes at M = 1 .. 256 rows: the
  old path (split-K skinny kernel up to 16 rows, dequantize + cuBLAS above) against the tensor-core GEMM
  (kvserve/ops/triton_int_mma.py), and which one int_matmul.INT_PATHS (printed) selects at each M.
* fp8: FP8 layers (per-channel scales, bf16 activations) of the same shapes: the old path (the W8A16 kernel
  of triton_fp8_gemm.py up to 16 rows, per-token quantization + torch._scaled_mm above) against the one-launch
  decode kernel (kvserve/ops/triton_fp8_gemv.py), and what fp8_matmul.FP8_PATHS (printed) selects.
  int4 and fp8 rows are timed from CUDA-graph replays over several copies of the layer's weights (so they
  come from HBM, not the 50 MB L2), and checked against the fp32 product of the dequantized weight
  (max |err| / max |ref|). `--sweep` also times candidate launch configurations of the new kernels (the
  best per M goes into the tables).

Timing: triton.testing.do_bench (median of many runs, L2 flushed between them), in microseconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

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


def _prefill_batch(ctx: int, q_len: int, block_size: int = 16, heads: tuple[int, int, int] = (32, 8, 128)):
    """One request: q_len new tokens after ctx cached ones, bf16, paged; heads: (query heads, KV heads,
    head_dim), Llama-3.1-8B's by default."""
    return _paged_batch([(ctx, q_len)], block_size, heads)


def _paged_batch(requests: list[tuple[int, int]], block_size: int = 16, heads: tuple[int, int, int] = (32, 8, 128)):
    """requests: (cached tokens, new tokens) each, in the batch's order; their blocks shuffled over one cache."""
    from kvserve.ops.attention_metadata import AttentionMetadata

    h, hkv, d = heads
    seqs = [ctx + q_len for ctx, q_len in requests]
    nbs = [-(-seq // block_size) for seq in seqs]
    g = torch.Generator(device="cuda").manual_seed(sum(seqs))
    total_blocks = sum(nbs) + 8
    perm = torch.randperm(total_blocks, device="cuda", generator=g).to(torch.int32)
    table = torch.zeros(len(requests), max(nbs), dtype=torch.int32, device="cuda")
    slots, used = [], 0
    for i, ((ctx, _), seq, nb) in enumerate(zip(requests, seqs, nbs)):
        table[i, :nb] = perm[used:used + nb]
        used += nb
        pos = torch.arange(ctx, seq, device="cuda")
        slots.append(table[i, pos // block_size].long() * block_size + pos % block_size)
    q_lens = [q_len for _, q_len in requests]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    seq_t = torch.tensor(seqs, dtype=torch.int32, device="cuda")
    tokens = sum(q_lens)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), query_start_loc=qsl, seq_lens=seq_t, block_tables=table,
                             max_query_len=max(q_lens), max_seq_len=max(seqs), num_actual_tokens=tokens,
                             block_size=block_size, query_start_loc_cpu=qsl.cpu(), seq_lens_cpu=seq_t.cpu())
    q = torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cache = torch.randn(2, total_blocks, block_size, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, cache, meta


def w2_steps(steps: list[int], budget: int = 16384) -> dict[int, list[tuple[int, int]]]:
    """The (cached, new) tokens of each request in W2's steps `steps` (0-based) under chunked prefill: each step
    the running requests decode one token, then the budget's rest goes to the waiting prompts in order (no
    request finishes this early: outputs are 128+ tokens)."""
    from kvserve.bench.datasets import w2_requests

    prompts = [r.prompt_len for r in w2_requests()]
    done = [0] * len(prompts)  # prompt tokens computed
    out_tokens = [0] * len(prompts)
    batches = {}
    for step in range(max(steps) + 1):
        batch = [(prompts[i] + out_tokens[i] - 1, 1) for i in range(len(prompts)) if done[i] == prompts[i]]
        left = budget - len(batch)
        for i in range(len(prompts)):
            if done[i] == prompts[i]:
                out_tokens[i] += 1
        for i in range(len(prompts)):
            if left and done[i] < prompts[i]:
                n = min(left, prompts[i] - done[i])
                batch.append((done[i], n))
                done[i] += n
                left -= n
                if done[i] == prompts[i]:
                    out_tokens[i] += 1  # its first token comes from this step
        batches[step] = batch
    return {step: batches[step] for step in steps}


def _time_runs(rows_out: list, section: str, case: str, runs: list, flops: float | None = None) -> dict[str, float]:
    """Each (name, run) checked against the first run that works, then timed: a row each, or an error row for
    a run that fails (a configuration that does not fit in shared memory: reported, not fatal). With flops,
    the rows also give TFLOP/s. Returns {name: us}."""
    reference, times = None, {}
    for name, run in runs:
        row = {"section": section, "case": case, "config": name}
        try:
            out = run().float()
        except Exception as exc:
            rows_out.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        reference = out if reference is None else reference
        row["max_abs_diff_vs_current"] = round((out - reference).abs().max().item(), 4)
        times[name] = us = bench(run)
        row["us"] = round(us, 1)
        if flops:
            row["tflops"] = round(flops / us / 1e6, 1)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    return times


# (BLOCK_M, TILE_N, num_warps, num_stages) candidates; None: what the backend picks for that query length now
# (launch_config: PREFILL_CONFIG, or (WIDE_HEAD_)LONG_PREFILL_CONFIG from LONG_PREFILL_MIN_QUERY tokens).
PREFILL_CONFIGS = [None, (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 2),
                   (128, 64, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2),
                   (64, 32, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2)]  # the last three for head_dim 256


# Gemma-3-12B: (query heads, KV heads, head_dim), its local layers' window, its global and local layers.
GEMMA_HEADS, GEMMA_WINDOW, GEMMA_GLOBAL_LAYERS, GEMMA_LOCAL_LAYERS = (16, 8, 256), 1024, 8, 40

# (label, (query heads, KV heads, head_dim), sliding window, [(cached tokens, new tokens)]): Llama-3.1-8B (the
# 8k TTFT and W2 rows), Gemma-3-12B's global and local (1,024-token window) layers (its W2 row).
PREFILL_SHAPES = [
    ("llama-3.1-8b", (32, 8, 128), None, [(0, 8192), (0, 16384), (6144, 2048)]),
    ("gemma-3-12b global", GEMMA_HEADS, None, [(0, 8192), (6144, 2048)]),
    ("gemma-3-12b local", GEMMA_HEADS, GEMMA_WINDOW, [(0, 8192), (6144, 2048)]),
]


def _vllm_flash_attention(q, cache, meta, scale, window):
    """vLLM 0.26.0's FlashAttention 3 on the same paged cache (the bundle unpacked in /tmp/vllmsite): the
    baseline row of each prefill case (`--vllm-fa`)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return lambda: flash_attn_varlen_func(
        q, cache[0], cache[1], max_seqlen_q=meta.max_query_len, cu_seqlens_q=meta.query_start_loc,
        max_seqlen_k=meta.max_seq_len, seqused_k=meta.seq_lens, softmax_scale=scale, causal=True,
        window_size=[window - 1, 0] if window else None, block_table=meta.block_tables, fa_version=3)


def prefill(rows_out: list, shapes: list[str] | None = None, configs: list | None = None,
            vllm_fa: bool = False) -> None:
    """shapes: labels' prefixes to run (all by default); configs: the launch configurations (PREFILL_CONFIGS);
    vllm_fa: vLLM's FlashAttention 3 as well."""
    from kvserve.ops.triton_attention import TritonAttentionBackend

    for label, heads, window, cases in PREFILL_SHAPES:
        if shapes and not any(label.startswith(prefix) for prefix in shapes):
            continue
        h, _, d = heads
        for ctx, q_len in cases:
            current = TritonAttentionBackend().launch_config(q_len, d)
            q, k, v, cache, meta = _prefill_batch(ctx, q_len, heads=heads)
            scale = d ** -0.5
            # causal FLOPs: 2 GEMMs x 2 flops x heads x d x (keys each query sees, within the window)
            keys_seen = sum(min(ctx + i + 1, window or ctx + i + 1) for i in range(q_len))
            flops = 4 * h * d * keys_seen
            case = f"{label}: ctx {ctx} + {q_len}"
            runs = []
            for config in configs or PREFILL_CONFIGS:
                launch = tuple(config) if config else current
                backend = TritonAttentionBackend()
                backend.PREFILL_CONFIG = backend.LONG_PREFILL_CONFIG = launch
                backend.WIDE_HEAD_LONG_PREFILL_CONFIG = launch
                name = f"{launch}{' (current)' if config is None else ''}"
                runs.append((name, lambda b=backend: b.forward(q, k, v, cache, meta, scale, sliding_window=window)))
            if vllm_fa:  # after the first run has written the new keys into the cache
                runs.append(("vLLM 0.26.0 FlashAttention 3", _vllm_flash_attention(q, cache, meta, scale, window)))
            _time_runs(rows_out, "prefill", case, runs, flops)
            del q, k, v, cache, meta
            torch.cuda.empty_cache()


W2_STEPS = [2, 3, 4, 5, 20, 40]  # the profile's prefill window (benchmarks/profile_w2_steps.py), then later ones


def prefill_w2(rows_out: list, vllm_fa: bool = False, configs: list | None = None, variants: list | None = None,
               steps: list[int] | None = None, block_sizes: list[int] | None = None) -> None:
    """Gemma-3-12B's attention in W2's real prefill steps (w2_steps: chunks of two or three prompts beside the
    decodes of the prompts already done), a global and a local layer each: the backend as it is, with
    MIXED_STEP_DECODE_KERNEL off, with each of `configs` as its long-prefill launch configuration, with each of
    `variants` (TritonAttentionBackend attribute sets), and vLLM's FlashAttention 3; then a step's 8 global + 40
    local layers. steps: W2_STEPS by default; block_sizes: the paged cache's (16, the engine's default)."""
    from kvserve.ops.triton_attention import TritonAttentionBackend

    def backend(**attrs) -> TritonAttentionBackend:
        b = TritonAttentionBackend()
        for name, value in attrs.items():
            setattr(b, name, tuple(value) if isinstance(value, list) else value)
        return b

    kernels = [("kvserve", backend()), ("kvserve, one launch", backend(MIXED_STEP_DECODE_KERNEL=False))]
    kernels += [(f"kvserve {tuple(c)}", backend(WIDE_HEAD_LONG_PREFILL_CONFIG=tuple(c))) for c in configs or [] if c]
    kernels += [("kvserve " + ", ".join(f"{k}={v}" for k, v in attrs.items()), backend(**attrs))
                for attrs in variants or []]
    for block_size in block_sizes or [16]:
        for step, requests in w2_steps(steps or W2_STEPS).items():
            q, k, v, cache, meta = _paged_batch(requests, block_size, heads=GEMMA_HEADS)
            scale = GEMMA_HEADS[2] ** -0.5
            decodes = sum(1 for _, n in requests if n == 1)
            per_layer = {}
            for window in (None, GEMMA_WINDOW):
                runs = [(name, lambda b=b, w=window: b.forward(q, k, v, cache, meta, scale, sliding_window=w))
                        for name, b in kernels]
                if vllm_fa:
                    runs.append(("vLLM 0.26.0 FlashAttention 3",
                                 _vllm_flash_attention(q, cache, meta, scale, window)))
                case = (f"W2 step {step} ({decodes} decodes), {'local' if window else 'global'} layer, "
                        f"block size {block_size}")
                for name, us in _time_runs(rows_out, "prefill-w2", case, runs).items():
                    per_layer[(name, window)] = us
            for name, _ in runs:
                if (name, None) not in per_layer or (name, GEMMA_WINDOW) not in per_layer:
                    continue
                step_us = (GEMMA_GLOBAL_LAYERS * per_layer[(name, None)]
                           + GEMMA_LOCAL_LAYERS * per_layer[(name, GEMMA_WINDOW)])
                rows_out.append({"section": "prefill-w2", "case": f"W2 step {step}: 8 global + 40 local layers, "
                                 f"block size {block_size}", "config": name, "us": round(step_us, 1)})
            del q, k, v, cache, meta
            torch.cuda.empty_cache()
    _print_compiled_resources("_unified_attention_kernel")


def _print_compiled_resources(kernel_name: str) -> None:
    """Registers, spills and shared memory of each compiled specialization of a triton_attention kernel."""
    import kvserve.ops.triton_attention as ta

    fn = getattr(ta, kernel_name)
    try:
        for caches in getattr(fn, "device_caches", {}).values():
            for key, compiled in caches[0].items():
                print(json.dumps({"kernel": kernel_name, "n_regs": getattr(compiled, "n_regs", None),
                                  "n_spills": getattr(compiled, "n_spills", None),
                                  "shared": getattr(compiled.metadata, "shared", None),
                                  "num_warps": getattr(compiled.metadata, "num_warps", None),
                                  "key": str(key)[-400:]}), flush=True)
    except Exception as exc:  # triton's cache layout is not an API
        print(f"compiled resources unavailable: {type(exc).__name__}: {exc}")


# Llama-3.1-8B's linear layers, (K, N).
LINEAR_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
LINEAR_MS = (1, 8, 16, 32, 64, 128, 256)
L2_DEFEAT_BYTES = 256 << 20  # weight bytes each replay streams, in copies of the layer
INT4_GROUP = 128
INT4_TOL, W8A16_TOL, W8A8_TOL = 2e-2, 2e-2, 0.1  # of max |ref|; W8A8 also quantizes the activations


def _bench_copies(fn, copies: int) -> float:
    """us per call of fn(i) over `copies` weight copies, from CUDA-graph replays."""
    import triton.testing

    def run():
        for i in range(copies):
            fn(i)
    return 1e3 * triton.testing.do_bench_cudagraph(run, rep=15) / copies


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()


def _timed(fn, copies: int, ref: torch.Tensor) -> dict:
    try:
        err = _rel_err(fn(0), ref)
        return {"us": _bench_copies(fn, copies), "err": err}
    except Exception as exc:  # a configuration that does not compile or fit is reported, not fatal
        return {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}


def _int4_layer(k: int, n: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    return {"qweight": torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda", generator=g),
            "scales": (torch.rand(k // INT4_GROUP, n, device="cuda", generator=g) * 0.01 + 0.001).to(torch.bfloat16),
            "zeros": torch.randint(0, 16, (k // INT4_GROUP, n), device="cuda", generator=g).to(torch.bfloat16)}


def _int4_reference_weight(layer: dict) -> torch.Tensor:
    """W [K, N] bf16 by torch ops: (q - z) * s in fp32, rounded once, as IntWeights.dequantize."""
    from kvserve.model.quantization.int_weights import unpack_rows

    q = unpack_rows(layer["qweight"], 4)
    k, n = q.shape
    q = q.view(k // INT4_GROUP, INT4_GROUP, n).float()
    w = (q - layer["zeros"].float()[:, None]) * layer["scales"].float()[:, None]
    return w.reshape(k, n).to(torch.bfloat16)


def _mma_candidates(m: int) -> list:
    block_m = max(16, min(128, 1 << (m - 1).bit_length()))
    out = [(128, block_m, 64, 4, 4), (128, block_m, 128, 4, 3), (64, block_m, 128, 4, 4), (128, block_m, 64, 8, 3),
           (256, block_m, 64, 8, 3)]
    return out + ([(128, 64, 64, 4, 4), (128, 64, 128, 4, 3)] if block_m > 64 else [])


def int4(rows_out: list, sweep: bool = False) -> None:
    from kvserve.model.quantization import int_matmul as rule
    from kvserve.ops.triton_int_dequant import dequantize_int
    from kvserve.ops.triton_int_gemv import skinny_int_gemm
    from kvserve.ops.triton_int_mma import mma_int_gemm

    for name, (k, n) in LINEAR_SHAPES.items():
        weight_bytes = k * n // 2 + 2 * (k // INT4_GROUP) * n * 2  # packed weight, bf16 scales and zeros
        copies = max(2, min(16, -(-L2_DEFEAT_BYTES // weight_bytes)))
        layers = [_int4_layer(k, n) for _ in range(copies)]
        w_ref = _int4_reference_weight(layers[0]).float()
        for m in LINEAR_MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ w_ref
            args = lambda i: (layers[i]["qweight"], layers[i]["scales"], layers[i]["zeros"], None, 4, INT4_GROUP)
            if m <= rule.SKINNY_MAX_M:
                config = rule.skinny_config(m, 4)
                split = rule.skinny_split_k(n, k, x.device, config, m)
                old_name, old = "skinny", lambda i: skinny_int_gemm(x, *args(i), split, config)
            else:
                old_name, old = "dequant+cuBLAS", lambda i: torch.matmul(x, dequantize_int(*args(i), x.dtype))
            path = rule.int_path(m)
            mma_config = rule.mma_config(m)
            row = {"section": "int4", "shape": name, "K": k, "N": n, "M": m, "old": old_name,
                   "old_run": _timed(old, copies, ref), "new_config": mma_config,
                   "new_run": _timed(lambda i: mma_int_gemm(x, *args(i), mma_config), copies, ref),
                   "selected": path.kernel, "bytes": weight_bytes, "flops": 2 * m * k * n}
            if sweep:
                row["sweep"] = {str(c): _timed(lambda i, c=c: mma_int_gemm(x, *args(i), c), copies, ref)
                                for c in _mma_candidates(m)}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        del layers, w_ref
        gc.collect()
        torch.cuda.empty_cache()


def _fp8_layer(k: int, n: int):
    from kvserve.ops.fp8_e4m3 import quantize_per_channel

    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05 * torch.rand(n, 1, device="cuda", generator=g)
    return quantize_per_channel(w)


GEMV_CANDIDATES = {1: [(16, 512, 4, 3), (32, 256, 4, 4), (8, 1024, 4, 3), (16, 1024, 8, 3), (64, 128, 4, 4),
                       (32, 512, 8, 3)],
                   16: [(64, 256, 4, 4), (64, 128, 4, 4), (128, 128, 8, 3), (64, 512, 8, 3), (128, 256, 8, 3),
                        (16, 256, 4, 4)]}


def fp8(rows_out: list, sweep: bool = False) -> None:
    from kvserve.model.quantization.fp8_matmul import GEMV_CONFIGS, fp8_path
    from kvserve.ops import fp8_quant
    from kvserve.ops.triton_fp8_gemm import w8a16_gemm
    from kvserve.ops.triton_fp8_gemv import MAX_ROWS, fp8_gemv

    for name, (k, n) in LINEAR_SHAPES.items():
        copies = max(2, min(16, -(-L2_DEFEAT_BYTES // (k * n))))
        layers = [_fp8_layer(k, n) for _ in range(copies)]
        w_ref = layers[0][0].float() * layers[0][1][:, None]
        for m in LINEAR_MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ w_ref.T
            if m <= 16:
                old_name, old = "w8a16", lambda i: w8a16_gemm(x, *layers[i])
            else:
                def old(i):
                    xq, xs = fp8_quant.quantize_per_token(x)
                    return torch._scaled_mm(xq, layers[i][0].t(), scale_a=xs, scale_b=layers[i][1].view(1, -1),
                                            out_dtype=torch.bfloat16)
                old_name = "quant+scaled_mm"
            path = fp8_path(m)
            row = {"section": "fp8", "shape": name, "K": k, "N": n, "M": m, "old": old_name,
                   "old_run": _timed(old, copies, ref), "selected": path.kernel, "bytes": k * n,
                   "flops": 2 * m * k * n}
            if m <= MAX_ROWS:
                config = GEMV_CONFIGS[1 if m == 1 else MAX_ROWS]
                row["new_config"] = config
                row["new_run"] = _timed(lambda i: fp8_gemv(x, *layers[i], config), copies, ref)
                if sweep:
                    row["sweep"] = {str(c): _timed(lambda i, c=c: fp8_gemv(x, *layers[i], c), copies, ref)
                                    for c in GEMV_CANDIDATES[1 if m == 1 else 16]}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        del layers, w_ref
        gc.collect()
        torch.cuda.empty_cache()


def _print_quant_tables(rows: list, section: str, table, measured: dict) -> list:
    """The section's markdown table and selection table; returns the rows whose error is over tolerance.
    measured[section] becomes the selection table the measurement supports: a bucket takes the new kernel (with
    the launch measured at the bucket's largest M) where it won at every M measured in the bucket."""
    bad = []
    sel = [r for r in rows if r["section"] == section]
    if not sel:
        return bad
    print(f"\n## {section}: time per layer (us), weights from HBM; err = max |err| / max |ref| vs fp32 dequantized")
    print("| layer | M | old path | old us | old GB/s | old TFLOP/s | new us | new GB/s | new TFLOP/s | old/new |"
          " err old / new | selected | best swept config (us) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sel:
        cells = []
        for key in ("old_run", "new_run"):
            run = r.get(key)
            if run is None:
                cells.append(("-", "-", "-", "-"))
            elif "error" in run:
                cells.append((f"failed: {run['error'][:60]}", "", "", "-"))
            else:
                cells.append((f"{run['us']:.1f}", f"{r['bytes'] / run['us'] / 1e3:.0f}",
                              f"{r['flops'] / run['us'] / 1e6:.1f}", f"{run['err']:.1e}"))
                tol = (W8A8_TOL if r["old"] == "quant+scaled_mm" and key == "old_run" else
                       INT4_TOL if section == "int4" else W8A16_TOL)
                if run["err"] > tol:
                    bad.append(r)
        ratio = "-"
        if "us" in (r.get("old_run") or {}) and "us" in (r.get("new_run") or {}):
            ratio = f"{r['old_run']['us'] / r['new_run']['us']:.2f}x"
        best = "-"
        if r.get("sweep"):
            ok = {c: v for c, v in r["sweep"].items() if "us" in v and v["err"] <= W8A16_TOL}
            if ok:
                c = min(ok, key=lambda c: ok[c]["us"])
                best = f"{c} ({ok[c]['us']:.1f})"
        (ou, og, ot, oe), (nu, ng, nt, ne) = cells
        print(f"| {r['shape']} {r['K']}->{r['N']} | {r['M']} | {r['old']} | {ou} | {og} | {ot} | {nu} | {ng} | {nt} | "
              f"{ratio} | {oe} / {ne} | {r['selected']} | {best} |")
    print(f"\n{section}: the engine's selection table now (max rows, kernel, config):")
    for entry in table:
        print(f"  {tuple(entry)}")
    # Per bucket of the table: the new kernel's and the old path's time summed over the four shapes (one
    # decoder layer's linears); the new kernel should serve the bucket where it wins at every M measured.
    print(f"{section}: new kernel vs old path per bucket, summed over the shapes (us):")
    low = 0
    for entry in table:
        ms = sorted({r["M"] for r in sel if low < r["M"] <= entry[0]})
        wins = []
        for m in ms:
            at_m = [r for r in sel if r["M"] == m]
            if all("us" in (r.get("new_run") or {}) and "us" in (r.get("old_run") or {}) for r in at_m):
                old_us = sum(r["old_run"]["us"] for r in at_m)
                new_us = sum(r["new_run"]["us"] for r in at_m)
                wins.append(new_us < old_us)
                print(f"  M={m}: old {old_us:.1f}, new {new_us:.1f} -> {'new' if new_us < old_us else 'old'}"
                      f" (selected: {entry[1]})")
        supported = tuple(entry)
        if wins:
            verdict = "new kernel" if all(wins) else "old path"
            print(f"  bucket up to {entry[0]} rows: the measurement supports the {verdict}")
            if all(wins):
                widest = max((r for r in sel if r["M"] in ms), key=lambda r: r["M"])
                supported = (entry[0], NEW_KERNEL[section], tuple(widest["new_config"]))
        measured.setdefault(section, []).append(supported)
        low = entry[0]
    return bad


# The kernel name a selection table gives the new kernel of each section.
NEW_KERNEL = {"int4": "mma", "fp8": "gemv"}


SECTIONS = {"int4": int4, "fp8": fp8, "fp8-fusion": fp8_fusion, "prefill": prefill, "prefill-w2": prefill_w2}


def _print_table(rows: list, section: str, header: str, format_row) -> None:
    """The section's rows as a markdown table under `header` (its separator line added), if it has rows."""
    section_rows = [r for r in rows if r["section"] == section]
    if section_rows:
        print(header + "\n|" + "---|" * (header.strip().count("|") - 1))
        for r in section_rows:
            print(format_row(r))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--sweep", action="store_true", help="int4, fp8: also time candidate launch configurations")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--prefill-shapes", default=None, help="prefill: comma-separated label prefixes (gemma,llama)")
    ap.add_argument("--prefill-configs", type=json.loads, default=None,
                    help="prefill: a JSON list of [BLOCK_M, TILE_N, warps, stages] (null: the current one)")
    ap.add_argument("--vllm-fa", action="store_true",
                    help="prefill: also vLLM 0.26.0's FlashAttention 3 from /tmp/vllmsite (bash .vllm/install.sh)")
    ap.add_argument("--prefill-variants", type=json.loads, default=None,
                    help="prefill-w2: a JSON list of TritonAttentionBackend attribute sets, each timed as well")
    ap.add_argument("--w2-steps", type=json.loads, default=None, help="prefill-w2: a JSON list of W2 steps")
    ap.add_argument("--w2-block-sizes", type=json.loads, default=None,
                    help="prefill-w2: a JSON list of cache block sizes ([16] by default)")
    args = ap.parse_args()
    if args.vllm_fa:
        sys.path.append("/tmp/vllmsite")
    rows: list[dict] = []
    for name in args.only.split(","):
        if name in ("int4", "fp8"):
            SECTIONS[name](rows, args.sweep)
        elif name == "prefill-w2":
            prefill_w2(rows, args.vllm_fa, args.prefill_configs, args.prefill_variants, args.w2_steps,
                       args.w2_block_sizes)
        elif name == "prefill":
            prefill(rows, args.prefill_shapes.split(",") if args.prefill_shapes else None, args.prefill_configs,
                    args.vllm_fa)
        else:
            SECTIONS[name](rows)
    with open(os.path.join(args.out, "ab_kernels.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    _print_table(rows, "fp8-fusion", "| case | before (us) | now (us) | now / before | same output |",
                 lambda r: f"| {r['case']} | {r['before_us']} | {r['now_us']} | {r['now_us'] / r['before_us']:.2f} | "
                           f"{r['same_output']} |")
    _print_table(rows, "prefill-w2",
                 "\n| W2 prefill step, Gemma-3-12B attention | kernel | us | max diff vs the first |",
                 lambda r: f"| {r['case']} | {r['config']} | {r.get('us', 'failed: ' + r.get('error', ''))} | "
                           f"{r.get('max_abs_diff_vs_current', '')} |")
    _print_table(rows, "prefill", "\n| prefill case | config (BLOCK_M, TILE_N, warps, stages) | us | TFLOP/s | "
                 "max diff vs current |",
                 lambda r: f"| {r['case']} | {r['config']} | failed: {r['error']} | | |" if "error" in r else
                 f"| {r['case']} | {r['config']} | {r['us']} | {r['tflops']} | {r['max_abs_diff_vs_current']} |")
    from kvserve.model.quantization.fp8_matmul import FP8_PATHS
    from kvserve.model.quantization.int_matmul import INT_PATHS

    bad = [r for r in rows if r.get("same_output") is False or r.get("max_abs_diff_vs_current", 0) > 0.05]
    measured: dict = {}
    bad += (_print_quant_tables(rows, "int4", INT_PATHS, measured)
            + _print_quant_tables(rows, "fp8", FP8_PATHS, measured))
    if measured:  # benchmarks/gpu_compare.py --kernel-paths runs the engine with these tables
        with open(os.path.join(args.out, "kernel_paths.json"), "w") as f:
            json.dump({"INT_PATHS" if s == "int4" else "FP8_PATHS": entries for s, entries in measured.items()}, f)
        print("selection tables the measurement supports:", json.dumps(measured))
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
