"""Flags shared by the bench subcommands (dataset choice, output), under vLLM's names plus short aliases."""

from __future__ import annotations

import argparse

from kvserve.bench.datasets import DATASETS, build_requests


def add_dataset_args(p: argparse.ArgumentParser, with_seed: bool) -> None:
    g = p.add_argument_group("Dataset options")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default="random",
                   help="random: uniform lengths and token ids; prefix: prompts sharing --num-prefixes prefixes "
                        "of --prefix-len tokens; sharegpt: a ShareGPT JSON file (--dataset-path); w1: the GPU "
                        "reference workload of docs/DESIGN.md (256 requests, Llama-3.1-8B vocabulary).")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (never downloaded).")
    g.add_argument("--num-prompts", type=int, default=None, help="Requests to run (default 1000; W1: 256).")
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=None,
                   help="random: prompt length; prefix: length after the shared prefix (default 1024).")
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None,
                   help="Output tokens per request (default 128; sharegpt: the reply's length).")
    g.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="Lengths are uniform in [len*(1-r), len*(1+r)] (default 0: fixed).")
    g.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens in each shared prefix.")
    g.add_argument("--num-prefixes", type=int, default=10, help="prefix: number of distinct shared prefixes.")
    if with_seed:  # the offline commands share the engine's --seed, as vLLM's do
        g.add_argument("--seed", type=int, default=0, help="Seed for the dataset and the arrival times.")


def requests_from_args(ns: argparse.Namespace, vocab_size: int | None, tokenizer=None):
    return build_requests(
        ns.dataset, num_prompts=ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len,
        range_ratio=ns.range_ratio, prefix_len=ns.prefix_len, num_prefixes=ns.num_prefixes,
        dataset_path=ns.dataset_path, seed=ns.seed, vocab_size=vocab_size, tokenizer=tokenizer,
    )


def write_json(path: str, data: dict) -> None:
    import json

    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"Results written to {path}")
