"""`kvserve bench throughput`: offline throughput of LLM.generate on a dataset, optionally against HF.

All requests are submitted at once (greedy, ignore_eos, max_tokens = the request's output length), so the
number measures the engine's batching, not arrival times. Output tokens are counted from what came back.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

from kvserve.bench.args import add_dataset_args, requests_from_args, write_json
from kvserve.bench.engine_setup import add_model_args, bench_engine_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)  # includes the engine's --seed, which also seeds the dataset
    add_dataset_args(p, with_seed=False)
    g = p.add_argument_group("Benchmark options")
    g.add_argument("--baseline", choices=("none", "hf"), default="none",
                   help="hf: also run HF transformers generate on the same requests and print the ratio.")
    g.add_argument("--hf-batch-size", type=int, default=32, help="Static batch size of the HF baseline.")
    g.add_argument("--disable-detokenize", action="store_true", help="Do not detokenize outputs.")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--output-json", default=None, help="Write the results to this JSON file.")


def _rates(n_requests: int, prompt_tokens: int, output_tokens: int, elapsed: float) -> dict:
    return {
        "elapsed_time": elapsed,
        "num_requests": n_requests,
        "total_num_tokens": prompt_tokens + output_tokens,
        "num_prompt_tokens": prompt_tokens,
        "num_output_tokens": output_tokens,
        "requests_per_second": n_requests / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def _throughput_line(r: dict) -> str:
    return (f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
            f"{r['output_tokens_per_second']:.2f} output tokens/s")


def _check_fits(requests, max_model_len: int) -> None:
    too_long = [r for r in requests if r.prompt_len + r.expected_output_len > max_model_len]
    if too_long:
        r = too_long[0]
        raise ValueError(f"{len(too_long)} request(s) need more than max_model_len={max_model_len} tokens "
                         f"(e.g. {r.prompt_len} prompt + {r.expected_output_len} output): raise --max-model-len "
                         f"or shorten --input-len/--output-len.")


def run_kvserve(engine_args, requests, detokenize: bool, use_tqdm: bool):
    """(elapsed seconds, RequestOutputs). A short warm-up on unrelated ids keeps one-time costs out without
    seeding the prefix cache with the measured prompts."""
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    llm = LLM.from_engine_args(engine_args)
    vocab = llm.llm_engine.config.model_config.vocab_size
    rng = random.Random(-1)
    warm = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(16)]} for _ in range(2)]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=r.expected_output_len, ignore_eos=True, detokenize=detokenize)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.engine_prompt() for r in requests], params, use_tqdm=use_tqdm)
    return time.perf_counter() - start, outputs, llm.llm_engine.config


def run(ns: argparse.Namespace) -> int:
    from kvserve.bench import machine

    with bench_engine_args(ns, ns.dataset) as engine_args:
        config = engine_args.create_engine_config()  # reads the model's metadata only: no weights yet
        tokenizer = None
        if ns.dataset == "sharegpt" and not engine_args.skip_tokenizer_init:
            from kvserve.model.default_model import load_tokenizer

            tokenizer = load_tokenizer(config.tokenizer_path)
        requests = requests_from_args(ns, config.model_config.vocab_size, tokenizer)
        _check_fits(requests, config.max_model_len)

        hf = None
        if ns.baseline == "hf":
            from kvserve.bench.hf_baseline import run_hf

            print(f"Running the HF transformers baseline (static batches of {ns.hf_batch_size}) ...", flush=True)
            hf = run_hf(config, requests, ns.hf_batch_size)  # first, so its memory is freed before kvserve sizes KV

        detokenize = not ns.disable_detokenize and not engine_args.skip_tokenizer_init
        elapsed, outputs, config = run_kvserve(engine_args, requests, detokenize, not ns.disable_tqdm)

    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(r.expected_output_len for r in requests)
    result = _rates(len(requests), prompt_tokens, output_tokens, elapsed)
    machine_line = machine.describe(config.device)
    result.update(command="throughput", dataset=ns.dataset, model=config.served_model_name,
                  expected_output_tokens=expected, machine=machine_line,
                  engine_args=dataclasses.asdict(config.args))

    print(_throughput_line(result))
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    if output_tokens != expected:
        print(f"WARNING: {output_tokens} output tokens generated, {expected} requested (ignore_eos was set).")
    if hf is not None:
        hf_rates = _rates(len(requests), hf.prompt_tokens, hf.output_tokens, hf.elapsed)
        ratio = result["output_tokens_per_second"] / hf_rates["output_tokens_per_second"]
        # Dummy weights are drawn separately for each engine, so their tokens are not comparable.
        same = None if config.args.load_format == "dummy" else sum(
            o.outputs[0].token_ids == h for o, h in zip(outputs, hf.outputs))
        agree = "n/a, dummy weights" if same is None else f"{same}/{len(requests)}"
        print(f"HF transformers generate (static batches of {hf.batch_size}): {_throughput_line(hf_rates)}")
        print(f"Ratio kvserve / HF: {ratio:.2f}x output tokens/s (identical greedy outputs: {agree})")
        result["baseline"] = {"name": "hf_transformers_generate", "batch_size": hf.batch_size, **hf_rates,
                              "identical_greedy_outputs": same}
        result["ratio_vs_baseline"] = ratio
    print(f"Machine: {machine_line}")
    if ns.output_json:
        write_json(ns.output_json, result)
    return 0
