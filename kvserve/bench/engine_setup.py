"""Engine arguments for the offline benchmarks, including the W1 model, which has a config but no weights."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import tempfile
from collections.abc import Iterator

from kvserve.bench.datasets import W1_MODEL_ALIAS, write_w1_config
from kvserve.config import EngineArgs
from kvserve.entrypoints.cli_args import add_engine_args, engine_args_from_namespace

W1_MAX_MODEL_LEN = 4096  # W1 needs 2048 (1024 in + 1024 out); the model's 131072 would only cost KV checks


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"HF model directory or .gguf (default: the embedded SmolLM2; with --dataset w1: "
                        f"{W1_MODEL_ALIAS}, i.e. Llama-3.1-8B's config with --load-format dummy).")
    add_engine_args(p)


@contextlib.contextmanager
def bench_engine_args(ns: argparse.Namespace, dataset: str | None = None) -> Iterator[EngineArgs]:
    """EngineArgs from the flags. `--model w1-llama-8b-dummy` (or no model with --dataset w1) becomes a
    temporary directory holding W1's config.json, loaded with dummy weights and no tokenizer."""
    use_w1 = ns.model == W1_MODEL_ALIAS or (ns.model is None and dataset == "w1")
    if not use_w1:
        yield engine_args_from_namespace(ns, ns.model)
        return
    with tempfile.TemporaryDirectory(prefix="kvserve-w1-") as path:
        write_w1_config(path)
        args = engine_args_from_namespace(ns, path)
        yield dataclasses.replace(args, load_format="dummy", skip_tokenizer_init=True,
                                  served_model_name=args.served_model_name or W1_MODEL_ALIAS,
                                  max_model_len=args.max_model_len or W1_MAX_MODEL_LEN)
