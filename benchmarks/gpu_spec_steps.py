"""Multi-token steps on the GPU: draft tokens verified by the runner give the greedy tokens of a run without
drafts, on every CUDA path (Triton attention with CUDA graphs: spec steps replay the mixed-step graphs;
--enforce-eager; async scheduling on and off), and what verifying costs per step.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_spec_steps.py [--out DIR] [--tiny]

The model is W1's shape scaled down (a dummy-weight bf16 Llama, 8 layers) so the run takes seconds. A
test-only proposer offers K drafts per request from the reference run, those at output positions 3, 8, 13, ... wrong. A table is
printed last; results go to DIR/gpu_spec_steps.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time

import torch

CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=5632,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000,
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
)
K = 3


class ReferenceProposer:
    def __init__(self, reference: dict[tuple[int, ...], list[int]]):
        self.reference = reference

    def propose(self, requests):
        out = {}
        for r in requests:
            ref = self.reference[tuple(r.prompt_token_ids)]
            n = len(r.output_token_ids)
            # Right tokens, but wrong ones at positions 3, 8, 13, ... and past the reference's end.
            out[r.request_id] = [ref[p] if p < len(ref) and p % 5 != 3 else (ref[min(p, len(ref) - 1)] + 1) % 32000
                                 for p in range(n, n + K)]
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="a 2-layer fp32 model: a smoke run on the CPU")
    args = ap.parse_args()
    config, dtype = CONFIG, "bfloat16"
    if args.tiny:
        config = {**CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "torch_dtype": "float32"}
        dtype = "float32"
    from kvserve import LLM, SamplingParams

    path = tempfile.mkdtemp(prefix="kvserve-spec-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    rng = random.Random(0)
    prompts = [[rng.randint(100, 31999) for _ in range(rng.randint(20, 300))] for _ in range(16)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    rows, results = [], {}
    for name, flags in [("graphs, async", {}), ("eager", dict(enforce_eager=True))]:
        llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_model_len=1024,
                  max_num_seqs=16, seed=0, **flags)
        engine = llm.llm_engine

        def run(llm=llm):
            return [o.outputs[0].token_ids
                    for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

        run()  # warm-up (Triton JIT)
        t = time.perf_counter()
        reference = run()
        base_s = time.perf_counter() - t
        engine.set_proposer(ReferenceProposer({tuple(p): r for p, r in zip(prompts, reference)}))
        for async_on in ((True, False) if engine.async_scheduling else (False,)):
            engine.async_scheduling = async_on
            sched = engine.scheduler
            drafted0, accepted0 = sched.num_draft_tokens, sched.num_accepted_tokens
            t = time.perf_counter()
            tokens = run()
            spec_s = time.perf_counter() - t
            row = dict(config=f"{name}{'' if async_on else ' (sync)'}", identical=tokens == reference,
                       drafted=sched.num_draft_tokens - drafted0, accepted=sched.num_accepted_tokens - accepted0,
                       seconds_without=round(base_s, 3), seconds_with=round(spec_s, 3))
            rows.append(row)
            print(row, flush=True)
        engine.set_proposer(None)
        engine.shutdown()
        del llm, engine, sched
        gc.collect()  # the engine's memory goes back before the next one sizes its KV cache
        torch.cuda.empty_cache()
    results["rows"] = rows
    with open(os.path.join(args.out, "gpu_spec_steps.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| config | greedy tokens identical with drafts | drafts accepted / offered | s without / with drafts |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['identical']} | {r['accepted']} / {r['drafted']} | "
              f"{r['seconds_without']} / {r['seconds_with']} |")


if __name__ == "__main__":
    main()
