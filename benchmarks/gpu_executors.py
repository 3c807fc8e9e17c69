"""W1 through the `mp` executor (one worker process, TP=1) against the in-process `uni` executor, in one
command: same greedy tokens, throughput ratio (target: mp >= 97% of uni), and what each step's broadcast
to the workers costs (bytes per step, ms per step).

    PYTHONUNBUFFERED=1 python benchmarks/gpu_executors.py --out $OUT [--quick]
    python benchmarks/gpu_executors.py --cpu-smoke   # a tiny model on CPU: checks that the script runs

mp runs first (its worker process then has the whole GPU), then uni in this process.
A table is printed last; full results go to OUT/gpu_executors.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_w1 import W1_CONFIG, greedy, w1_requests, write_config  # noqa: E402

TINY = dict(W1_CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, torch_dtype="float32")


def run(path: str, reqs, backend: str, engine_kw: dict) -> dict:
    import torch

    from kvserve import LLM

    t = time.perf_counter()
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, distributed_executor_backend=backend, **engine_kw)
    ready = time.perf_counter() - t
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    llm.generate(prompts[:8], [greedy(16)] * 8, use_tqdm=False)  # warm-up (JIT, allocator)
    executor = llm.llm_engine.executor
    if backend == "mp":
        executor.broadcast.__init__()  # count the timed run only
    assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, [greedy(o) for _, o in reqs], use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = [o.outputs[0].token_ids for o in outs]
    n_out = sum(len(x) for x in tokens)
    res = {"backend": backend, "start_to_ready_s": round(ready, 1), "seconds": round(elapsed, 2),
           "output_tokens": n_out, "output_tok_s": round(n_out / elapsed, 1)}
    if backend == "mp":
        b = executor.broadcast.summary()
        res.update(steps=b["steps"], broadcast_bytes_per_step=round(b["bytes_per_step"], 1),
                   broadcast_ms_per_step=round(1000 * b["seconds_per_step"], 4),
                   ms_per_step=round(1000 * elapsed / max(b["steps"], 1), 3))
    llm.llm_engine.shutdown()
    del llm, outs, executor
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    res["tokens"] = tokens
    print(backend, json.dumps({k: v for k, v in res.items() if k != "tokens"}), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="W1's first 64 requests only")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model, 8 short requests, on CPU")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    reqs = w1_requests()
    if args.cpu_smoke:
        path = write_config(TINY)
        reqs = [(p[:40], 8) for p, _ in reqs[:8]]
        engine_kw = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20)
    else:
        path = write_config(W1_CONFIG)
        reqs = reqs[:64] if args.quick else reqs
        engine_kw = dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)
    mp = run(path, reqs, "mp", engine_kw)
    uni = run(path, reqs, "uni", engine_kw)
    same = mp.pop("tokens") == uni.pop("tokens")
    ratio = mp["output_tok_s"] / uni["output_tok_s"]
    results = {"mp": mp, "uni": uni, "same_greedy_tokens": same, "mp_over_uni": round(ratio, 4)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_executors.json"), "w") as f:
        json.dump(results, f, indent=1)
    label = "W1 (quick)" if args.quick else ("CPU smoke" if args.cpu_smoke else "W1")
    print(f"\n| {label} | uni | mp (TP=1) |\n|---|---|---|")
    print(f"| output tok/s | {uni['output_tok_s']} | {mp['output_tok_s']} ({ratio:.3f}x; target >= 0.97) |")
    print(f"| same greedy tokens | | {same} |")
    print(f"| broadcast bytes/step; ms/step of {mp['ms_per_step']} ms steps | | "
          f"{mp['broadcast_bytes_per_step']}; {mp['broadcast_ms_per_step']} |")
    print(f"| start to ready (s) | {uni['start_to_ready_s']} | {mp['start_to_ready_s']} |")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
