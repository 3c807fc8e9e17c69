"""The draft budget over whole runs shaped like benchmarks/gpu_spec.py's part (c), on the CPU: which steps
draft, and what the proposer costs on the host, with `{"method": "ngram"}` against a run without it.

    PYTHONPATH=$PWD python benchmarks/cpu_spec_turn_down.py [--batches 64,256] [--rounds 3]

W1's first B requests (prompts of 100-1024 tokens, outputs capped at 128) on benchmarks/host_step_ab.py's
2-layer model with the forward faked and the greedy token a function of the position, so prompt lookup finds
no right drafts (as on random weights; the budget must learn that and turn itself down). The n-gram engine
gets the draft budget it would have on CUDA. Async scheduling is on. Per run: main-thread CPU seconds of the
whole run (best over rounds), steps, steps whose budget choice drafted (and why), the proposer's CPU time
and its slowest call, draft tokens, and whether the tokens equal the run without speculation. The run's tail
(requests finishing, the batch shrinking) is where a budget that drafts on its prior pays: the first drafting
step indexes every running request.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_w1 import w1_requests  # noqa: E402
from host_step_ab import NGRAM, TINY_CONFIG, _fake_model  # noqa: E402

OUTPUT_CAP = 128


def _run(batch: int, spec: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    from kvserve import LLM, SamplingParams
    from kvserve.sampling_params import RequestOutputKind
    from kvserve.spec_decode.drafter import Drafter

    path = tempfile.mkdtemp(prefix="kvserve-turn-down-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f)
    vocab = TINY_CONFIG["vocab_size"]
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=2048,
              max_num_seqs=256, kv_cache_memory_bytes=1 << 30, async_scheduling=True,
              **({"speculative_config": NGRAM} if spec else {}))
    engine = llm.llm_engine
    _fake_model(engine.runner.model, by_position=True)
    reasons: collections.Counter = collections.Counter()
    proposer_cpu, slowest = [0.0], [0.0]
    if spec:
        drafter = engine.drafter = engine.proposer = Drafter(engine.config.args.speculative_config, "cuda")
        propose = drafter.proposer.propose

        def timed_propose(requests, num_tokens=None):
            t = time.thread_time()
            out = propose(requests, num_tokens)
            dt = time.thread_time() - t
            proposer_cpu[0] += dt
            slowest[0] = max(slowest[0], dt)
            return out
        drafter.proposer.propose = timed_propose
    for i, (prompt, out_len) in enumerate(w1_requests()[:batch]):
        # W1's ids are for a 128k vocabulary; folded into the tiny model's.
        engine.add_request(str(i), {"prompt_token_ids": [3 + t % (vocab - 3) for t in prompt]},
                           SamplingParams(max_tokens=min(out_len, OUTPUT_CAP), temperature=0, ignore_eos=True,
                                          detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY))
    steps, tokens = 0, {}
    t = time.thread_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if spec:
            reasons[engine.drafter.last_choice.reason] += 1
    cpu = time.thread_time() - t
    totals = engine.drafter.totals if spec else None
    engine.shutdown()
    return {"cpu_s": cpu, "steps": steps, "choices": dict(reasons), "proposer_cpu_s": proposer_cpu[0],
            "slowest_proposer_call_ms": slowest[0] * 1e3, "draft_tokens": totals.num_draft_tokens if totals else 0,
            "tokens": [tokens[k] for k in sorted(tokens, key=int)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print("| batch | run | CPU s (best of rounds) | steps | budget's choices per step | proposer CPU s "
          "| slowest proposer call, ms | draft tokens | tokens as off |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        rounds = {"off": [], "ngram": []}
        for i in range(args.rounds):
            for name in (("off", "ngram") if i % 2 == 0 else ("ngram", "off")):
                rounds[name].append(_run(batch, name == "ngram"))
        off_tokens = rounds["off"][0]["tokens"]
        for name, runs in rounds.items():
            best = min(runs, key=lambda r: r["cpu_s"])
            choices = ", ".join(f"{n} {reason}" for reason, n in sorted(best["choices"].items(), key=lambda x: -x[1]))
            same = all(r["tokens"] == off_tokens for r in runs)
            print(f"| {batch} | {name} | {best['cpu_s']:.2f} | {best['steps']} | {choices or '-'} | "
                  f"{best['proposer_cpu_s']:.3f} | {best['slowest_proposer_call_ms']:.1f} | {best['draft_tokens']} "
                  f"| {same} |", flush=True)


if __name__ == "__main__":
    main()
