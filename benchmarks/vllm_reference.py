"""vLLM 0.26.0 on W1, batch-1 and time to first token at 128 and 2,048 tokens, in one `LLM(...)`: the
baseline that benchmarks/gpu_w1.py divides by (`--vllm-json`), measured in the same device command.

GPU machine, after the vLLM bundle's install script has unpacked vLLM into /tmp/vllmsite (BENCHMARKS.md says
how the bundle travels):

    PYTHONPATH=/tmp/vllmsite:.vllm python benchmarks/vllm_reference.py --out $OUT

The requests come from the bundle's own `vllm_bench.py` (imported, not copied): W1 = make_workload(), the
batch-1 prompt = make_latency_prompt(). The method is the bundle script's: greedy, ignore_eos, token-id prompts,
no detokenization, W1 best of `--passes` with the prefix cache reset before each; TTFT = LLM.generate with
max_tokens=1 on an idle engine, prefix cache reset, best of 5 after 2 warm-ups (as gpu_w1.py measures kvserve).
It writes vllm_bench.json with the bundle script's keys plus ttft_128_ms and ttft_2048_ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    for k, v in {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    import vllm
    import vllm_bench  # the bundle's script: the workload definitions only
    from vllm import LLM, SamplingParams

    model_dir = vllm_bench.MODEL_DIR
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(vllm_bench.LLAMA8B_CONFIG, f)

    def sp(n):
        return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)

    t = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              gpu_memory_utilization=0.90, max_model_len=4096, seed=0)
    res = {"vllm_version": vllm.__version__, "init_s": round(time.perf_counter() - t, 1)}
    llm.generate([{"prompt_token_ids": list(range(1000, 1032))}], sp(16), use_tqdm=False)

    reqs = vllm_bench.make_workload()
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    passes = []
    for _ in range(args.passes):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, [sp(n) for _, n in reqs], use_tqdm=False)
        passes.append(time.perf_counter() - t)
    out_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tok == sum(n for _, n in reqs), "vLLM produced a different number of tokens than asked"
    res.update(passes_s=[round(p, 3) for p in passes], output_tokens=out_tok,
               vllm_offline_out_tok_per_s=round(out_tok / min(passes), 1))

    for n in (128, 2048):
        rng = random.Random(1)  # the batch-1 prompt's generator: its first 128 ids are that prompt
        ids = [rng.randint(100, 119999) for _ in range(n)]
        best = float("inf")
        for i in range(7):
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], sp(1), use_tqdm=False)
            if i >= 2:
                best = min(best, time.perf_counter() - t)
        res[f"ttft_{n}_ms"] = round(best * 1e3, 2)

    ids, n = vllm_bench.make_latency_prompt()
    llm.reset_prefix_cache()
    t = time.perf_counter()
    o = llm.generate([{"prompt_token_ids": ids}], sp(n), use_tqdm=False)
    lat = time.perf_counter() - t
    res.update(bs1_out_tokens=len(o[0].outputs[0].token_ids), bs1_elapsed_s=round(lat, 3),
               bs1_out_tok_per_s=round(len(o[0].outputs[0].token_ids) / lat, 1))
    import torch

    res["gpu"], res["torch"] = torch.cuda.get_device_name(0), torch.__version__
    with open(os.path.join(args.out, "vllm_bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
