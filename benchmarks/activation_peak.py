"""Which tensors make the activation peak that start-up sizing measures (GPU only).

    PYTHONPATH=. python3 benchmarks/activation_peak.py [--model DIR] [--max-num-batched-tokens N] [--max-num-seqs N]

Loads the model with dummy weights (the W2 Gemma-3-12B shape of kvserve/bench/datasets.py unless --model), then
repeats the engine's profile run (ModelRunner.profile_run) under torch's allocator history, replays the history to
the moment of the peak and prints the tensors alive then, summed by the kvserve line that allocated them. The
scratch KV cache of the profile run is listed too; start-up sizing leaves it out of the activation peak.
"""

from __future__ import annotations

import argparse
import collections

import torch


def live_at_peak(trace: list[dict]) -> tuple[int, dict[int, dict]]:
    """Replays allocator events; returns the peak of the bytes allocated after recording began and what was live."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: dict[int, dict] = {}
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return peak, at_peak


def where(event: dict) -> str:
    """The innermost kvserve frame that allocated the tensor (else the innermost Python frame)."""
    frames = event.get("frames") or []
    for frame in frames:
        if "/kvserve/" in frame["filename"]:
            return f"{frame['filename'].split('/kvserve/')[-1]}:{frame['line']} {frame['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a model directory (default: the W2 Gemma-3-12B shape)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()

    from kvserve import LLM
    from kvserve.bench.datasets import W2_MAX_MODEL_LEN, write_w2_config

    path = args.model or write_w2_config()
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=W2_MAX_MODEL_LEN,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              enforce_eager=True)
    worker = llm.llm_engine.executor.worker
    runner = worker.runner
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    scratch = runner.profile_run(args.max_num_batched_tokens, args.max_num_seqs)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated() - before
    peak, live = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()])
    by_site = collections.defaultdict(lambda: [0, 0])
    for event in live.values():
        site = by_site[where(event)]
        site[0] += event["size"]
        site[1] += 1
    mib = 2**20
    print(f"\n{torch.cuda.get_device_name()}: {args.max_num_batched_tokens} tokens over {args.max_num_seqs} requests")
    print(f"peak measured {measured / mib:,.0f} MiB (replayed {peak / mib:,.0f}); scratch KV {scratch / mib:,.0f} MiB; "
          f"activation peak as sized {(measured - scratch) / mib:,.0f} MiB; at start-up "
          f"{worker.startup.activation_peak / mib:,.0f} MiB")
    print("| MiB | tensors | allocated at |\n|---|---|---|")
    for site, (size, count) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| {size / mib:,.0f} | {count} | {site} |")


if __name__ == "__main__":
    main()
