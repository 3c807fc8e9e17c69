"""Quantization on the GPU, in one command: the W1 model shape (Llama-3.1-8B, dummy weights) in bf16,
with --quantization fp8 (W8A8), --kv-cache-dtype fp8, both, and AWQ int4.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/gpu_quant.py --out $OUT [--num-requests 256]

Per configuration, one engine: first correctness against the bf16 engine of the same run (8 prompts of
W1, 32 greedy tokens: how many tokens agree before the first split, and the teacher-forced logprob error
of bf16's tokens), then W1 output tok/s and batch-1 tok/s. The AWQ engine's weights are the bf16 dummy
weights quantized by round-to-nearest (group 128, zero points) on the GPU and copied into its packed
parameters, so its agreement with bf16 is meaningful. Dummy weights give nearly flat next-token
distributions: small numeric differences flip argmaxes far more often than on a trained model, so read
the logprob error first. A table is printed last; everything goes to OUT/gpu_quant.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time

import torch

from benchmarks.gpu_w1 import W1_CONFIG, add_w1_run_args, batch1_request, greedy, run_kvserve, w1_requests, write_config

CHECK_PROMPTS, CHECK_TOKENS = 8, 32
AWQ_GROUP = 128
KNOBS = "_knobs"  # {"package.module.CONSTANT": value} set for one configuration, then restored


def set_knobs(knobs: dict) -> dict:
    """Sets module constants; returns what restores them."""
    import importlib

    old = {}
    for path, value in knobs.items():
        module, attr = path.rsplit(".", 1)
        mod = importlib.import_module(module)
        old[path] = getattr(mod, attr)
        setattr(mod, attr, value)
    return old


def engine_kwargs(args) -> dict:
    return dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)


def check_prompts(reqs):
    return [p[:128] for p, _ in reqs[:CHECK_PROMPTS]]


def greedy_tokens(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(CHECK_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def teacher_forced_logprobs(llm, sequences):
    """Logprob of each next token of the given sequences (prompt + bf16's greedy output)."""
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [torch.tensor([d[t].logprob for t, d in zip(s[1:], o.prompt_logprobs[1:])])
            for s, o in zip(sequences, outs)]


def compare(tokens, logprobs, ref_tokens, ref_logprobs) -> dict:
    agree = []
    for a, b in zip(tokens, ref_tokens):
        split = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        agree.append(split)
    err = torch.cat([(a - b).abs() for a, b in zip(logprobs, ref_logprobs)])
    return {"identical_sequences": sum(a == CHECK_TOKENS for a in agree),
            "mean_tokens_before_split": round(sum(agree) / len(agree), 1),
            "logprob_abs_err_mean": round(err.mean().item(), 4), "logprob_abs_err_max": round(err.max().item(), 4)}


@torch.no_grad()
def awq_served_tensors(model) -> dict[str, dict[str, torch.Tensor]]:
    """Every quantizable linear's bf16 weight [N, K] -> the served int4 layout (int_weights.py), by
    round-to-nearest with zero points per group of AWQ_GROUP input rows; kept on the CPU."""
    from kvserve.model.quantization.int_weights import pack_rows

    out = {}
    for name, module in model.named_modules():
        if not name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            continue
        wt = module.weight.float().t()  # [K, N]
        k, n = wt.shape
        grouped = wt.reshape(k // AWQ_GROUP, AWQ_GROUP, n)
        wmax, wmin = grouped.amax(1), grouped.amin(1)
        scales = ((wmax - wmin).clamp(min=1e-5) / 15).to(torch.bfloat16).float()
        zeros = torch.clamp(torch.round(-wmin / scales), 0, 15)
        q = torch.clamp(torch.round(grouped / scales[:, None]) + zeros[:, None], 0, 15).reshape(k, n)
        out[name] = {"qweight": pack_rows(q.to(torch.int32), 4).cpu(), "scales": scales.to(torch.bfloat16).cpu(),
                     "zeros": zeros.to(torch.bfloat16).cpu()}
        del wt, grouped, q
    return out


@torch.no_grad()
def copy_into(model, awq_tensors, float_params):
    """In place (CUDA graphs captured at start-up keep pointing at these parameters)."""
    for name, tensors in awq_tensors.items():
        module = model.get_submodule(name)
        for attr, t in tensors.items():
            getattr(module, attr).data.copy_(t)
    params = dict(model.named_parameters())
    for name, t in float_params.items():
        params[name].data.copy_(t)


def release_device_memory():
    """After the caller dropped its engine: the engine's reference cycles hold its KV cache until collected."""
    gc.collect()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    add_w1_run_args(ap)
    ap.add_argument("--only", default=None, help="comma-separated config names (bf16 always runs)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from kvserve import LLM

    major, minor = torch.cuda.get_device_capability()
    results = {"device": torch.cuda.get_device_name(), "capability": f"{major}.{minor}", "torch": torch.__version__,
               "configs": {}}
    reqs = w1_requests()[: args.num_requests]
    prompts = check_prompts(w1_requests())
    path = write_config(W1_CONFIG)
    configs = {
        "bf16": {},
        "fp8": {"quantization": "fp8"},
        # An A/B row for the rule that picks a kernel by rows (read at call time; each engine captures its own
        # graphs): fp8 with every M through the Triton quantization + _scaled_mm (no W8A16 for decode).
        "fp8-scaled-mm-only": {"quantization": "fp8",
                               KNOBS: {"kvserve.model.quantization.fp8_matmul.FP8_PATHS": ((1 << 62, "scaled_mm", None),)}},
        # A/B of the fused activation quantization: RMSNorm and SiLU*mul write bf16 and each FP8 linear
        # quantizes its own input (one more kernel and one more read + write of every GEMM input).
        "fp8-unfused-quant": {"quantization": "fp8",
                              KNOBS: {"kvserve.model.quantization.fp8.FUSE_ACTIVATION_QUANT": False}},
        "kv-fp8": {"kv_cache_dtype": "fp8"},
        "fp8+kv-fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
        "awq-int4": "awq",
    }
    wanted = ["bf16"] + [c for c in configs if c != "bf16" and (not args.only or c in args.only.split(","))]
    ref = None
    awq_tensors = float_params = None
    for name in wanted:
        extra = {"awq": True} if configs[name] == "awq" else dict(configs[name])
        knobs = extra.pop(KNOBS, {})
        t0 = time.perf_counter()
        llm = None
        restore = {}
        try:
            restore = set_knobs(knobs)
            if extra.pop("awq", False):
                cfg = dict(W1_CONFIG, quantization_config={"quant_method": "awq", "bits": 4, "group_size": AWQ_GROUP,
                                                           "zero_point": True, "version": "gemm"})
                llm = LLM(write_config(cfg), **engine_kwargs(args))
                copy_into(llm.llm_engine.executor.runner.model, awq_tensors, float_params)
            else:
                llm = LLM(path, **engine_kwargs(args), **extra)
            res = {"start_to_ready_s": round(time.perf_counter() - t0, 1),
                   "weight_GiB": round(llm.llm_engine.executor.worker.weights_bytes / 2**30, 2),
                   "kv_tokens": llm.llm_engine.executor.runner.num_blocks * llm.llm_engine.config.args.block_size}
            tokens = greedy_tokens(llm, prompts)
            if name == "bf16":
                sequences = [p + t for p, t in zip(prompts, tokens)]
                ref = (tokens, teacher_forced_logprobs(llm, sequences))
                model = llm.llm_engine.executor.runner.model
                awq_tensors = awq_served_tensors(model)
                float_params = {n: p.detach().cpu() for n, p in model.named_parameters()
                                if not n.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight"))}
            res["vs_bf16"] = compare(tokens, teacher_forced_logprobs(llm, [p + t for p, t in zip(prompts, ref[0])]),
                                     *ref)
            print(name, "check:", json.dumps(res), flush=True)
            run_kvserve(llm, [(p, 16) for p, _ in reqs[:8]], f"{name}_warmup", {})
            timing = {}
            run_kvserve(llm, [batch1_request()], "batch1", timing)
            run_kvserve(llm, reqs, "w1", timing)
            res["batch1"], res["w1"] = timing["batch1"], timing["w1"]
        except Exception as exc:  # one failing configuration must not hide the others' numbers
            logging.exception("config %s failed", name)
            res = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            set_knobs(restore)
        if knobs:
            res["knobs"] = knobs
        results["configs"][name] = res
        with open(os.path.join(args.out, "gpu_quant.json"), "w") as f:
            json.dump(results, f, indent=1)
        llm = model = None
        release_device_memory()

    base = results["configs"]["bf16"]
    n_req = f"W1 ({args.num_requests} req)" if args.num_requests != 256 else "W1"
    print(f"\n{results['device']} (cc {results['capability']}), torch {results['torch']}")
    print(f"| config | {n_req} out tok/s | vs bf16 | batch-1 tok/s | vs bf16 | identical seqs / "
          f"tokens before split (of {CHECK_TOKENS}) | logprob err mean / max | weights GiB | KV tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results["configs"].items():
        if "error" in r:
            print(f"| {name} | FAILED: {r['error'][:120]} | | | | | | | |")
            continue
        w, b, c = r["w1"]["output_tok_s"], r["batch1"]["output_tok_s"], r["vs_bf16"]
        wb = base.get("w1", {}).get("output_tok_s")
        bb = base.get("batch1", {}).get("output_tok_s")
        print(f"| {name} | {w} | {w / wb:.2f}x | {b} | {b / bb:.2f}x | {c['identical_sequences']}/{CHECK_PROMPTS} / "
              f"{c['mean_tokens_before_split']} | {c['logprob_abs_err_mean']} / {c['logprob_abs_err_max']} | "
              f"{r['weight_GiB']} | {r['kv_tokens']} |")


if __name__ == "__main__":
    main()
