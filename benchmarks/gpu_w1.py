"""Everything a GPU run checks and measures, in one command (see docs/DESIGN.md, workload W1).

    PYTHONUNBUFFERED=1 python benchmarks/gpu_w1.py [--out DIR] [--skip-hf] [--quick]

1. parity: a small random bf16 Llama, kvserve (triton backend, CUDA graphs) vs HF transformers greedy on
   8 prompts; where bf16 rounding makes them part, the HF logit margin at the split is printed. Also
   triton vs torch backend and graphs vs --enforce-eager: identical greedy tokens.
2. W1: Llama-3.1-8B shape, dummy bf16 weights, 256 requests (144,581 prompt / 151,597 output tokens).
3. HF `generate` baseline on a slice of W1 (static batch), and kvserve on the same slice.
4. batch-1 decode: 128-token prompt, 512 output tokens.
A table is printed last; full results go to DIR/gpu_w1.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import tempfile
import time

import torch

W1_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
)


def w1_requests():
    rng = random.Random(0)
    reqs = []
    for _ in range(256):
        in_len = rng.randint(100, 1024)
        out_len = rng.randint(100, 1024)
        reqs.append(([rng.randint(100, 119999) for _ in range(in_len)], out_len))
    assert sum(len(p) for p, _ in reqs) == 144581 and sum(o for _, o in reqs) == 151597
    assert len(reqs[0][0]) == 964 and reqs[0][1] == 494
    return reqs


def batch1_request():
    rng = random.Random(1)
    return [rng.randint(100, 119999) for _ in range(128)], 512


def write_config(cfg: dict) -> str:
    path = tempfile.mkdtemp(prefix="kvserve-w1-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def add_w1_run_args(ap) -> None:
    """The options every W1 engine run shares: where results go, how much of W1, the engine's batch limits."""
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--num-requests", type=int, default=256, help="W1's first N requests (256 = all of W1)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)


def greedy(max_tokens):
    from kvserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


# ---- 1. parity ------------------------------------------------------------------------------------
def hf_bf16_reference(cfg, prefix: str, num_prompts: int = 8, n_new: int = 32):
    """A random bf16 HF model from `cfg` saved to a temporary folder, with its greedy tokens for random prompts
    and the top-2 logit margin at every step (a split at a small margin is a bf16 near-tie, not a bug)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    path = tempfile.mkdtemp(prefix=prefix)
    hf.save_pretrained(path)
    rng = random.Random(2)
    prompts = [[rng.randint(3, 31999) for _ in range(rng.randint(5, 400))] for _ in range(num_prompts)]
    expected, margins = [], []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            expected.append(out.sequences[0, len(p):].tolist())
            margins.append([(lg[0].float().topk(2).values[0] - lg[0].float().topk(2).values[1]).item()
                            for lg in out.logits])
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return path, prompts, expected, margins


def splits_against_hf(prompts, expected, margins, got) -> list[dict]:
    """Per prompt: identical to HF, or where it first splits and HF's top-2 margin there."""
    rows = []
    for i, (exp, tokens) in enumerate(zip(expected, got)):
        split = next((j for j, (a, b) in enumerate(zip(exp, tokens)) if a != b), None)
        rows.append({"prompt_len": len(prompts[i]), "identical": split is None, "first_split": split,
                     "hf_top2_logit_margin_at_split": None if split is None else round(margins[i][split], 4)})
    return rows


def parity(results: dict) -> bool:
    import transformers

    from kvserve import LLM

    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_theta=500000.0,
    )
    path, prompts, expected, margins = hf_bf16_reference(cfg, "kvserve-parity-")
    n_new = len(expected[0])

    def run(**kw):
        llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n_new), use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        del llm, outs
        gc.collect()
        torch.cuda.empty_cache()
        return tokens

    triton_graphs = run(attention_backend="triton")
    triton_graphs_sync = run(attention_backend="triton", async_scheduling=False)
    triton_eager = run(attention_backend="triton", enforce_eager=True)
    torch_eager = run(attention_backend="torch", enforce_eager=True)
    # A 256-token budget chunks every prompt: steps of <= 512 tokens run in the mixed-step graphs.
    chunked_graphs = run(attention_backend="triton", max_num_batched_tokens=256)
    chunked_eager = run(attention_backend="triton", enforce_eager=True, max_num_batched_tokens=256)
    rows = splits_against_hf(prompts, expected, margins, triton_graphs)
    results["parity"] = {
        "vs_hf": rows,
        "identical_vs_hf": sum(r["identical"] for r in rows),
        "graphs_equal_eager": triton_graphs == triton_eager,
        "async_equal_sync": triton_graphs == triton_graphs_sync,
        "triton_equal_torch_backend": triton_eager == torch_eager,
        "mixed_graphs_equal_eager": chunked_graphs == chunked_eager,
        "chunked_identical_vs_hf": sum(a == b for a, b in zip(expected, chunked_graphs)),
    }
    print("parity:", json.dumps(results["parity"]), flush=True)
    splits_are_ties = all(r["identical"] or r["hf_top2_logit_margin_at_split"] < 0.25 for r in rows)
    return triton_graphs == triton_eager == triton_graphs_sync and chunked_graphs == chunked_eager and splits_are_ties


# ---- 2-4. speed ----------------------------------------------------------------------------------
class StepTimer:
    """Splits an engine's wall time per step into scheduling, launching (input build + kernel launches),
    waiting for the GPU (reading a step's sampled ids back) and the scheduler update; the rest of a step
    is output processing. With async scheduling, waiting is time the GPU is busy and the host is not."""

    def __init__(self, engine):
        from kvserve.worker.runner_output import PendingOutput

        self.sched = self.launch = self.wait = self.update = 0.0
        self.steps = 0
        sched, runner = engine.scheduler, engine.runner
        orig_schedule, orig_execute, orig_update = sched.schedule, runner.execute_async, sched.update
        orig_result = PendingOutput.result

        def schedule():
            t = time.perf_counter(); r = orig_schedule(); self.sched += time.perf_counter() - t; self.steps += 1
            return r

        def execute_async(out):
            t = time.perf_counter(); r = orig_execute(out); self.launch += time.perf_counter() - t
            return r

        def result(pending):
            t = time.perf_counter(); r = orig_result(pending); self.wait += time.perf_counter() - t
            return r

        def update(out, sampled):
            t = time.perf_counter(); r = orig_update(out, sampled); self.update += time.perf_counter() - t
            return r

        sched.schedule, runner.execute_async, sched.update = schedule, execute_async, update
        PendingOutput.result = result

        def restore():
            sched.schedule, runner.execute_async, sched.update = orig_schedule, orig_execute, orig_update
            PendingOutput.result = orig_result

        self.restore = restore


def triton_variants() -> int:
    """Compiled variants of our Triton kernels so far: a timed run should add none (JIT costs ~1 s each)."""
    from triton.runtime.jit import JITFunction

    from kvserve.ops import fused_kernels, triton_attention

    total = 0
    for module in (triton_attention, fused_kernels):
        for fn in vars(module).values():
            if isinstance(fn, JITFunction):
                total += sum(len(caches[0]) for caches in fn.device_caches.values())
    return total


def count_host_syncs(llm, sampled: bool = False) -> str:
    """Runs 32 decode steps of 8 requests under torch's sync debug mode: any hidden device-to-host sync
    (an .item(), a pageable copy) breaks the overlap of host and GPU work. `sampled`: temperature, top-k/p,
    min-p, half of them seeded, with logprobs, instead of greedy."""
    import warnings

    from kvserve import SamplingParams

    engine = llm.llm_engine
    for i in range(8):
        params = greedy(40)
        if sampled:
            params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, max_tokens=40,
                                    ignore_eos=True, seed=i if i % 2 else None, logprobs=2, detokenize=False)
        engine.add_request(f"sync{i}", {"prompt_token_ids": [100 + i] * 64}, params)
    for _ in range(4):
        engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        for _ in range(32):
            engine.step()
        torch.cuda.set_sync_debug_mode(0)
    while engine.has_unfinished_requests():
        engine.step()
    messages = sorted({str(w.message).splitlines()[0][:120] for w in caught})
    print("host syncs:", len(caught), messages, flush=True)
    return f"{len(caught)} {messages[:2]}"


def run_kvserve(llm, reqs, label, results):
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [greedy(o) for _, o in reqs]
    # Earlier runs' prompts sit in the prefix cache: every timed run starts from an empty one.
    assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    timer = StepTimer(llm.llm_engine)
    variants = triton_variants()
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    timer.restore()
    variants = triton_variants() - variants
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(o for _, o in reqs), (n_out, sum(o for _, o in reqs))
    res = {"seconds": round(elapsed, 2), "output_tokens": n_out, "output_tok_s": round(n_out / elapsed, 1),
           "steps": timer.steps, "ms_per_step": round(1000 * elapsed / max(timer.steps, 1), 3),
           "schedule_ms_per_step": round(1000 * timer.sched / max(timer.steps, 1), 3),
           "launch_ms_per_step": round(1000 * timer.launch / max(timer.steps, 1), 3),
           "gpu_wait_ms_per_step": round(1000 * timer.wait / max(timer.steps, 1), 3),
           "update_ms_per_step": round(1000 * timer.update / max(timer.steps, 1), 3),
           "async_scheduling": llm.llm_engine.async_scheduling, "triton_compiles_during_run": variants}
    results[label] = res
    print(label, json.dumps(res), flush=True)
    return outs


def measure_ttft(llm, num_tokens: int, results, repeats: int = 5) -> float:
    """Time to first token of one prompt on an idle engine: LLM.generate with max_tokens=1, best of
    `repeats`, prefix cache reset before each (vllm_bench.py measures vLLM the same way at 128 tokens)."""
    rng = random.Random(1)
    ids = [rng.randint(100, 119999) for _ in range(num_tokens)]
    best = float("inf")
    for i in range(repeats + 2):  # two warm-ups
        assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], greedy(1), use_tqdm=False)
        if i >= 2:
            best = min(best, time.perf_counter() - t)
    results[f"ttft_{num_tokens}_ms"] = round(best * 1e3, 2)
    print(f"ttft_{num_tokens}_ms", results[f"ttft_{num_tokens}_ms"], flush=True)
    return best


def hf_baseline(path_cfg: dict, reqs, batch: int, out_len: int, results):
    import transformers

    cfg = transformers.LlamaConfig(**{k: v for k, v in path_cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    slice_ = reqs[:batch]
    width = max(len(p) for p, _ in slice_)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in slice_], device="cuda")
    mask = (ids != 0).long()
    with torch.no_grad():
        model.generate(input_ids=ids[:, :16], attention_mask=mask[:, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
    n = batch * out_len
    results["hf_slice"] = {"batch": batch, "out_len": out_len, "seconds": round(elapsed, 2), "output_tok_s": round(n / elapsed, 1)}
    print("hf_slice", json.dumps(results["hf_slice"]), flush=True)
    del model
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--quick", action="store_true", help="W1's first 64 requests only")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--compare-sync", action="store_true", help="also run batch-1 and W1 with async scheduling off")
    ap.add_argument("--sync-check-only", action="store_true", help="only look for hidden host syncs in decode steps")
    ap.add_argument("--ttft-only", action="store_true",
                    help="only time to first token at 128 and 2,048 tokens (for an A/B of two trees on one machine)")
    ap.add_argument("--vllm-json", help="vllm_bench.py's JSON written earlier in the same device command: "
                                        "print ratios against it")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    ok = True
    if not args.skip_parity:
        ok = parity(results)

    reqs = w1_requests()
    slice_batch, slice_out = 32, 128
    if not args.skip_hf:
        hf_baseline(W1_CONFIG, reqs, slice_batch, slice_out, results)

    from kvserve import LLM

    path = write_config(W1_CONFIG)
    t = time.perf_counter()
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager)
    results["start_to_ready_s"] = round(time.perf_counter() - t, 1)
    results["triton_variants_after_start"] = triton_variants()
    if args.sync_check_only:
        for sampled in (False, True):
            print("sampled" if sampled else "greedy", count_host_syncs(llm, sampled))
        return
    print("start_to_ready_s", results["start_to_ready_s"], flush=True)
    if args.ttft_only:
        llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:8]], greedy(16), use_tqdm=False)  # works on old trees
        measure_ttft(llm, 128, results, repeats=20)
        measure_ttft(llm, 2048, results, repeats=10)
        with open(os.path.join(args.out, "gpu_w1_ttft.json"), "w") as f:
            json.dump(results, f, indent=1)
        return
    run_kvserve(llm, [(p, 16) for p, _ in reqs[:8]], "warmup", results)
    run_kvserve(llm, [(p, slice_out) for p, _ in reqs[:slice_batch]], "kvserve_slice", results)
    run_kvserve(llm, [batch1_request()], "batch1", results)
    measure_ttft(llm, 128, results)
    measure_ttft(llm, 2048, results)
    work = reqs[:64] if args.quick else reqs
    run_kvserve(llm, work, "w1", results)
    results["host_syncs_in_decode"] = count_host_syncs(llm)
    results["host_syncs_in_sampled_decode"] = count_host_syncs(llm, sampled=True)
    if args.compare_sync:  # the same engine with async scheduling off, then on again: ratios in one command
        llm.llm_engine.async_scheduling = False
        run_kvserve(llm, [batch1_request()], "batch1_sync", results)
        run_kvserve(llm, work, "w1_sync", results)
        llm.llm_engine.async_scheduling = True
        run_kvserve(llm, [batch1_request()], "batch1_again", results)
        run_kvserve(llm, work, "w1_again", results)

    with open(os.path.join(args.out, "gpu_w1.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| measure | kvserve | baseline |\n|---|---|---|")
    if "parity" in results:
        p = results["parity"]
        print(f"| greedy identical vs HF (8 prompts, bf16) | {p['identical_vs_hf']}/8 | splits at HF top-2 margins "
              f"{[r['hf_top2_logit_margin_at_split'] for r in p['vs_hf'] if not r['identical']]} |")
        print(f"| graphs == eager tokens / triton == torch | {p['graphs_equal_eager']} / {p['triton_equal_torch_backend']} | |")
        print(f"| 256-token chunks: mixed-step graphs == eager / identical vs HF | {p['mixed_graphs_equal_eager']} / "
              f"{p['chunked_identical_vs_hf']}/8 | |")
    if "hf_slice" in results:
        ratio = results["kvserve_slice"]["output_tok_s"] / results["hf_slice"]["output_tok_s"]
        print(f"| W1 slice {slice_batch}x{slice_out} out tok/s | {results['kvserve_slice']['output_tok_s']} | "
              f"HF generate {results['hf_slice']['output_tok_s']} ({ratio:.2f}x) |")
    w = results["w1"]
    vllm = {}
    if args.vllm_json and os.path.exists(args.vllm_json):
        with open(args.vllm_json) as f:
            vllm = json.load(f)
        results["vllm"] = vllm

    def versus(ours: float, key: str, higher_is_better: bool = True) -> str:
        if key not in vllm:
            return "vLLM not run"
        ratio = ours / vllm[key] if higher_is_better else vllm[key] / ours
        return f"vLLM {vllm.get('vllm_version', '')} same run: {vllm[key]} ({ratio:.2f}x)"

    print(f"| W1{' (quick)' if args.quick else ''} output tok/s | {w['output_tok_s']} ({w['seconds']} s) | "
          f"{versus(w['output_tok_s'], 'vllm_offline_out_tok_per_s')} |")
    for key in ("w1", "w1_sync", "w1_again", "batch1", "batch1_sync", "batch1_again"):
        if key in results:
            r = results[key]
            print(f"| {key}: tok/s; ms/step total / schedule / launch / GPU wait / update; JIT compiles | "
                  f"{r['output_tok_s']}; {r['ms_per_step']} / {r['schedule_ms_per_step']} / {r['launch_ms_per_step']} / "
                  f"{r['gpu_wait_ms_per_step']} / {r['update_ms_per_step']}; {r['triton_compiles_during_run']} | |")
    if "w1_sync" in results:
        print(f"| W1 async / sync scheduling | {w['output_tok_s'] / results['w1_sync']['output_tok_s']:.2f}x | "
              f"sync {results['w1_sync']['output_tok_s']} |")
    b = results["batch1"]
    print(f"| batch-1 decode tok/s | {b['output_tok_s']} ({b['ms_per_step']} ms/step) | {versus(b['output_tok_s'], 'bs1_out_tok_per_s')} |")
    if "bs1_prefill_plus_1tok_s" in vllm:
        vllm["ttft_128_ms"] = round(vllm["bs1_prefill_plus_1tok_s"] * 1e3, 2)
    print(f"| TTFT, 128-token prompt, idle (ms) | {results['ttft_128_ms']} | {versus(results['ttft_128_ms'], 'ttft_128_ms', False)} |")
    print(f"| TTFT, 2,048-token prompt, idle (ms) | {results['ttft_2048_ms']} | {versus(results['ttft_2048_ms'], 'ttft_2048_ms', False)} |")
    if "batch1_sync" in results:
        print(f"| batch-1 async / sync scheduling | {b['output_tok_s'] / results['batch1_sync']['output_tok_s']:.2f}x | "
              f"sync {results['batch1_sync']['output_tok_s']} |")
    print(f"| sync-debug warnings in 32 decode steps: greedy / sampled | {results['host_syncs_in_decode']} / "
          f"{results['host_syncs_in_sampled_decode']} | |")
    print(f"| LLM(...) start to ready (s) | {results['start_to_ready_s']} | {versus(results['start_to_ready_s'], 'init_s', False)} |")
    print(f"| correctness | {'OK' if ok else 'FAILED'} | |")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
