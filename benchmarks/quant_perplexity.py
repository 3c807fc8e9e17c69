"""Perplexity of SmolLM2-135M-Instruct, fp32 vs quantized, on a fixed text shipped in the repo.

    PYTHONPATH=. python benchmarks/quant_perplexity.py [--out results.json] [--only awq-int4,fp8-online]

The text (benchmarks/data/perplexity_text.txt): the first two paragraphs of the US Declaration of
Independence (1776, public domain) and a paragraph about the water cycle written for this file. The
quantized checkpoints are made from the embedded GGUF's weights by the reference round-to-nearest
quantizers of tests/quant_utils.py (no calibration data: AWQ/GPTQ proper would do better). Perplexity
= exp(mean negative log-likelihood of every token after the first), from kvserve's prompt logprobs.
On CPU, FP8 is weight-only (activations stay fp32); on a GPU with FP8 tensor cores it is W8A8.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name -> (checkpoint method and options, or None for the fp32 checkpoint; engine kwargs)
CONFIGS = {
    "fp32": (None, {}, {}),
    "fp8-online (--quantization fp8)": (None, {}, {"quantization": "fp8"}),
    "fp8 checkpoint (per-tensor)": ("fp8", {}, {}),
    "compressed-tensors fp8 (per-channel)": ("compressed-tensors", {"per_channel": True}, {}),
    "awq-int4 g64": ("awq", {"group_size": 64}, {}),
    "gptq-int4 g64 sym": ("gptq", {"bits": 4, "group_size": 64, "sym": True}, {}),
    "gptq-int4 g64 asym act-order": ("gptq", {"bits": 4, "group_size": 64, "sym": False, "desc_act": True}, {}),
    "gptq-int8 g64": ("gptq", {"bits": 8, "group_size": 64, "sym": True}, {}),  # 576 = 9 x 64
    "fp32 + fp8 KV cache": (None, {}, {"kv_cache_dtype": "fp8"}),
    "awq-int4 g64 + fp8 KV cache": ("awq", {"group_size": 64}, {"kv_cache_dtype": "fp8"}),
}


def perplexity(llm, token_ids: list[int]) -> float:
    from kvserve import SamplingParams

    (out,) = llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)
    nll = [-d[tok].logprob for tok, d in zip(token_ids[1:], out.prompt_logprobs[1:])]
    return math.exp(sum(nll) / len(nll))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write results as JSON here")
    ap.add_argument("--only", default=None, help="comma-separated prefixes of config names")
    args = ap.parse_args()

    from kvserve import LLM
    from kvserve.model.default_model import find_default_gguf, load_tokenizer
    from tests.quant_utils import make_smollm2_checkpoint, smollm2_weights

    text = (REPO / "benchmarks/data/perplexity_text.txt").read_text()
    tokens = load_tokenizer(find_default_gguf()).encode(text)
    names = [n for n in CONFIGS if not args.only or any(n.startswith(p) for p in args.only.split(","))]
    root = Path(tempfile.mkdtemp(prefix="kvserve-ppl-"))
    source = smollm2_weights()
    built: dict[tuple, Path] = {}
    rows = []
    for name in names:
        method, opt, engine_kw = CONFIGS[name]
        key = (method, tuple(sorted(opt.items())))
        if key not in built:
            built[key] = make_smollm2_checkpoint(root / f"{method}-{len(built)}", method, source, **opt)
        t0 = time.perf_counter()
        llm = LLM(str(built[key]), max_model_len=1024, kv_cache_memory_bytes=64 << 20, **engine_kw)
        ppl = perplexity(llm, tokens)
        weights = llm.llm_engine.executor.worker.weights_bytes
        rows.append({"config": name, "perplexity": round(ppl, 4), "weight_MiB": round(weights / 2**20, 1),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{name}: ppl {ppl:.4f}", flush=True)
        del llm

    base = next((r["perplexity"] for r in rows if r["config"] == "fp32"), None)
    machine = f"{platform.machine()} {platform.processor() or ''} CPU".strip()
    print(f"\nSmolLM2-135M-Instruct, {len(tokens)} tokens of benchmarks/data/perplexity_text.txt, fp32 CPU ({machine})")
    print("| config | perplexity | vs fp32 | weights (MiB, as served) |")
    print("|---|---|---|---|")
    for r in rows:
        rel = f"{r['perplexity'] / base - 1:+.2%}" if base else "-"
        print(f"| {r['config']} | {r['perplexity']:.3f} | {rel} | {r['weight_MiB']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"tokens": len(tokens), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
