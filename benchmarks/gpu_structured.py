"""Structured outputs on W1's shape: the cost of a JSON-schema constraint on a 256-request batch.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_structured.py [--out DIR] [--num-prompts 256]

The W1 model (Llama-3.1-8B shape, dummy bf16 weights) with the SmolLM2 tokenizer saved beside it (grammars
are over a tokenizer's tokens; the model's larger vocabulary is masked out beyond it). The same 256 W1
prompts and max_tokens run three ways: unconstrained (ignore_eos, as W1), and with a JSON schema, with
async scheduling on (the default on CUDA) and off. A constrained request ends when its object closes, so
its output is shorter: tokens/s is the measure, with the output tokens of each run printed beside it.
Correctness: every constrained output that finished ("stop") parses and validates against the schema.
Per-step host time building the bitmask (StructuredOutputManager.grammar_bitmask) and the GPU time of one
bitmask apply on [256, vocab] logits are printed. A table is printed last; results go to DIR/gpu_structured.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 64},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 16},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "string",
                                                                                         "maxLength": 128}},
                   "required": ["ok", "note"]},
    },
    "required": ["id", "name", "tags", "scores", "nested"],
}


def model_dir() -> str:
    from kvserve.bench.datasets import write_w1_config
    from kvserve.model.default_model import find_default_gguf, load_tokenizer

    path = write_w1_config()
    load_tokenizer(find_default_gguf()).save_pretrained(path)
    return path


def run(path: str, reqs, constrained: bool, async_scheduling: bool, max_model_len: int = 4096) -> dict:
    from kvserve import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(path, load_format="dummy", dtype="bfloat16", async_scheduling=async_scheduling,
              max_model_len=max_model_len)
    engine = llm.llm_engine
    mask_times = []
    if constrained and engine.structured_output is not None:
        build = engine.structured_output.grammar_bitmask

        def timed(scheduled):
            t0 = time.perf_counter()
            result = build(scheduled)
            if result[0] is not None:
                mask_times.append((time.perf_counter() - t0, result[0].shape[0]))
            return result

        engine.structured_output.grammar_bitmask = timed
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, detokenize=False,
                             structured_outputs=so) for _, out_len in reqs]
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up (graphs, grammar compile)
    mask_times.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"constrained": constrained, "async_scheduling": async_scheduling, "seconds": elapsed,
              "output_tokens": num_out, "tokens_per_s": num_out / elapsed,
              "finished_stop": sum(o.outputs[0].finish_reason == "stop" for o in outs)}
    if constrained:
        import jsonschema

        tok = llm.get_tokenizer()
        valid = invalid = 0
        for o in outs:
            c = o.outputs[0]
            if c.finish_reason != "stop":
                continue
            try:
                jsonschema.validate(json.loads(tok.decode(c.token_ids, skip_special_tokens=True), strict=False), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                invalid += 1
        result.update(valid=valid, invalid=invalid)
        if mask_times:
            per_step = [t for t, _ in mask_times]
            result.update(mask_steps=len(per_step), mask_ms_mean=1e3 * statistics.mean(per_step),
                          mask_ms_p99=1e3 * sorted(per_step)[int(0.99 * (len(per_step) - 1))],
                          mask_rows_mean=statistics.mean(r for _, r in mask_times))
    engine.shutdown()
    del llm, engine
    torch.cuda.empty_cache()
    return result


def apply_time(vocab: int = 128256, rows: int = 256) -> float:
    """GPU milliseconds of one bitmask apply on [rows, vocab] float32 logits (kvserve's apply function)."""
    from kvserve.structured_output.bitmask import apply_token_bitmask

    logits = torch.randn(rows, vocab, device="cuda")
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32)
    all_rows = list(range(rows))
    for _ in range(3):
        apply_token_bitmask(logits, bitmask, all_rows)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        apply_token_bitmask(logits, bitmask, all_rows)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--num-prompts", type=int, default=256)
    args = ap.parse_args()
    from kvserve.bench.datasets import w1_requests

    reqs = [(r.prompt_token_ids, r.expected_output_len) for r in w1_requests(args.num_prompts)]
    path = model_dir()
    try:
        results = [run(path, reqs, False, True), run(path, reqs, True, True), run(path, reqs, True, False)]
    finally:
        shutil.rmtree(path, ignore_errors=True)
    apply_ms = apply_time()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_structured.json"), "w") as f:
        json.dump({"runs": results, "apply_ms_256_rows": apply_ms, "device": torch.cuda.get_device_name()}, f,
                  indent=2)
    base = results[0]["tokens_per_s"]
    print(f"\n{torch.cuda.get_device_name()}: W1 prompts ({len(reqs)}), greedy, JSON schema constraint")
    print(f"{'run':34} {'out tok':>9} {'s':>7} {'tok/s':>9} {'vs free':>8} {'stop':>5} {'valid':>6} "
          f"{'mask ms/step':>13}")
    for r in results:
        name = ("constrained" if r["constrained"] else "unconstrained") + \
               (", async" if r["async_scheduling"] else ", sync")
        mask = f"{r['mask_ms_mean']:.2f} (p99 {r['mask_ms_p99']:.2f})" if "mask_ms_mean" in r else "-"
        valid = f"{r['valid']}/{r['valid'] + r['invalid']}" if r["constrained"] else "-"
        print(f"{name:34} {r['output_tokens']:9d} {r['seconds']:7.2f} {r['tokens_per_s']:9.0f} "
              f"{r['tokens_per_s'] / base:7.2f}x {r['finished_stop']:5d} {valid:>6} {mask:>13}")
    print(f"bitmask apply, 256 rows x 128256: {apply_ms:.3f} ms on the GPU")


if __name__ == "__main__":
    main()
