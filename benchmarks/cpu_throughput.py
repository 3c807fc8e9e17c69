"""CPU throughput: kvserve vs HF transformers `generate` on the same SmolLM2 requests, one command.

    python benchmarks/cpu_throughput.py [--num-prompts 32] [--hf-batch-size 32]

32 requests, prompts 64-256 random tokens, 64-128 output tokens each, greedy, ignore_eos. HF runs
static left-padded batches (its best case on CPU); only the requested tokens count for it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import torch


def make_requests(n: int, seed: int, vocab: int):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        in_len, out_len = rng.randint(64, 256), rng.randint(64, 128)
        reqs.append(([rng.randint(100, vocab - 1) for _ in range(in_len)], out_len))
    return reqs


def run_kvserve(reqs):
    from kvserve import LLM, SamplingParams

    llm = LLM(max_model_len=1024)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(o for _, o in reqs)
    return elapsed, n_out, [o.outputs[0].token_ids for o in outs]


def run_hf(reqs, batch_size: int):
    import transformers

    from kvserve.model.default_model import find_default_gguf

    gguf = find_default_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    pad = 0
    elapsed, n_out, outs = 0.0, 0, []
    with torch.no_grad():
        for start in range(0, len(reqs), batch_size):
            batch = reqs[start:start + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            max_new = max(o for _, o in batch)
            t = time.perf_counter()
            seq = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                 min_new_tokens=max_new, do_sample=False, pad_token_id=pad)
            elapsed += time.perf_counter() - t
            for row, (_, o) in zip(seq, batch):
                outs.append(row[width:width + o].tolist())
                n_out += o
    return elapsed, n_out, outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reqs = make_requests(args.num_prompts, args.seed, 49152)
    kv_t, kv_n, kv_outs = run_kvserve(reqs)
    hf_t, hf_n, hf_outs = run_hf(reqs, args.hf_batch_size)
    same = sum(a == b for a, b in zip(kv_outs, hf_outs))
    machine = f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    result = {
        "machine": machine,
        "num_prompts": len(reqs),
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "output_tokens": kv_n,
        "kvserve_s": round(kv_t, 2),
        "kvserve_out_tok_s": round(kv_n / kv_t, 1),
        "hf_s": round(hf_t, 2),
        "hf_out_tok_s": round(hf_n / hf_t, 1),
        "ratio": round((kv_n / kv_t) / (hf_n / hf_t), 2),
        "greedy_outputs_identical": f"{same}/{len(reqs)}",
    }
    print(json.dumps(result))
    print("\n| engine | time (s) | output tok/s |\n|---|---|---|")
    print(f"| kvserve | {kv_t:.2f} | {kv_n / kv_t:.1f} |")
    print(f"| HF generate (batch {args.hf_batch_size}) | {hf_t:.2f} | {hf_n / hf_t:.1f} |")
    print(f"ratio kvserve / HF: {result['ratio']}x on {machine}; identical greedy outputs: {same}/{len(reqs)}")


if __name__ == "__main__":
    main()
