"""`kvserve bench latency`: wall time of one batch end to end (vLLM's benchmark_latency, same output).

Each iteration gets fresh random prompts: repeating one batch would let the prefix cache turn every
iteration after the first into decode only.
"""

from __future__ import annotations

import argparse
import random
import time

from kvserve.bench.args import write_json
from kvserve.bench.engine_setup import add_model_args, bench_engine_args

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("Benchmark options")
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--input-len", type=int, default=32)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--num-iters-warmup", type=int, default=10)
    g.add_argument("--num-iters", type=int, default=30)
    g.add_argument("--disable-detokenize", action="store_true")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--output-json", default=None, help="Write the results to this JSON file.")


def run(ns: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    from kvserve.bench import machine
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    for flag in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}.")
    if ns.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {ns.num_iters_warmup}.")
    with bench_engine_args(ns) as engine_args:
        llm = LLM.from_engine_args(engine_args)
    config = llm.llm_engine.config
    if ns.input_len + ns.output_len > config.max_model_len:
        raise ValueError(f"--input-len + --output-len ({ns.input_len + ns.output_len}) exceeds max_model_len "
                         f"({config.max_model_len}).")
    vocab = config.model_config.vocab_size
    # vLLM samples here (temperature 1); ignore_eos pins every output at --output-len tokens.
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=ns.output_len,
                            detokenize=not ns.disable_detokenize and not engine_args.skip_tokenizer_init)
    rng = random.Random(ns.seed)
    expected = ns.batch_size * ns.output_len

    def one_batch() -> float:
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(ns.input_len)]}
                   for _ in range(ns.batch_size)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        if got != expected:
            raise RuntimeError(f"a batch generated {got} tokens, expected {expected}")
        return elapsed

    for _ in tqdm(range(ns.num_iters_warmup), desc="Warmup iterations", disable=ns.disable_tqdm):
        one_batch()
    latencies = np.array([one_batch() for _ in tqdm(range(ns.num_iters), desc="Profiling iterations",
                                                     disable=ns.disable_tqdm)])
    percentiles = np.percentile(latencies, PERCENTAGES)
    machine_line = machine.describe(config.device)
    print(f"Avg latency: {np.mean(latencies)} seconds")
    for pct, value in zip(PERCENTAGES, percentiles):
        print(f"{pct}% percentile latency: {value} seconds")
    print(f"Machine: {machine_line}")
    if ns.output_json:
        write_json(ns.output_json, {
            "command": "latency", "model": config.served_model_name, "batch_size": ns.batch_size,
            "input_len": ns.input_len, "output_len": ns.output_len, "output_tokens_per_iter": expected,
            "avg_latency": float(np.mean(latencies)), "latencies": latencies.tolist(),
            "percentiles": {str(p): float(v) for p, v in zip(PERCENTAGES, percentiles)}, "machine": machine_line,
        })
    return 0
