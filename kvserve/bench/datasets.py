"""Benchmark request sets: random, prefix (shared prefixes), ShareGPT (a user's file) and W1 (docs/DESIGN.md).

Every set is a list of SampleRequest and is reproducible from its seed. Synthetic sets are token ids;
ShareGPT prompts are text with their token ids alongside, so offline runs feed ids and HTTP runs text.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "sharegpt", "prefix", "w1", "w2")

# W1, the GPU reference workload: Llama-3.1-8B architecture with dummy weights (docs/DESIGN.md, "Measuring").
W1_MODEL_ALIAS = "w1-llama-8b-dummy"
W1_NUM_REQUESTS = 256
W1_PROMPT_TOKENS = 144_581
W1_OUTPUT_TOKENS = 151_597
W1_MIN_VOCAB = 120_000  # ids are drawn from [100, 119999]
W1_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}

# W2, the long-context GPU workload: a Gemma-3-12B-shaped text model (interleaved 1024-token windows) with
# dummy weights, 64 requests of 6,000-15,000 prompt and 128-512 output tokens, max_model_len 16384.
W2_NUM_REQUESTS = 64
W2_PROMPT_TOKENS = 713_959
W2_OUTPUT_TOKENS = 20_920
W2_MAX_MODEL_LEN = 16384
W2_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 3840,
    "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "vocab_size": 262208, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
    "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1,
}

# vLLM's ShareGPT filter (benchmarks/datasets.py: is_valid_sequence).
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text (ShareGPT) or token ids (synthetic sets)
    prompt_len: int
    expected_output_len: int
    prompt_token_ids: list[int] | None = None  # always set for offline runs; None only for text over HTTP

    def engine_prompt(self) -> dict:
        """The prompt as LLM.generate takes it; ids when known, so the engine sees exactly prompt_len tokens."""
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": self.prompt_token_ids}
        return {"prompt": self.prompt}


def _lens(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}.")
    lo = max(1, int(length * (1 - range_ratio)))
    hi = max(lo, int(length * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int) -> list[SampleRequest]:
    """Uniform lengths in [len*(1-r), len*(1+r)] and uniform token ids over the vocabulary."""
    rng = random.Random(seed)
    in_lens = _lens(rng, num_prompts, input_len, range_ratio)
    out_lens = _lens(rng, num_prompts, output_len, range_ratio)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = [rng.randrange(vocab_size) for _ in range(n_in)]
        out.append(SampleRequest(ids, n_in, n_out, ids))
    return out


def prefix_requests(num_prompts: int, prefix_len: int, num_prefixes: int, input_len: int, output_len: int,
                    range_ratio: float, vocab_size: int, seed: int) -> list[SampleRequest]:
    """num_prompts prompts, each one of num_prefixes shared prefixes (prefix_len ids) + its own suffix.

    Shuffled so that requests sharing a prefix are not adjacent, as in vLLM's prefix_repetition set.
    """
    if num_prefixes < 1:
        raise ValueError(f"--num-prefixes must be >= 1, got {num_prefixes}.")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    suffix_lens = _lens(rng, num_prompts, input_len, range_ratio)
    out_lens = _lens(rng, num_prompts, output_len, range_ratio)
    out = []
    for i, (n_suffix, n_out) in enumerate(zip(suffix_lens, out_lens)):
        ids = prefixes[i % num_prefixes] + [rng.randrange(vocab_size) for _ in range(n_suffix)]
        out.append(SampleRequest(ids, len(ids), n_out, ids))
    rng.shuffle(out)
    return out


def w1_requests(num_prompts: int | None = None) -> list[SampleRequest]:
    """W1 exactly as docs/DESIGN.md draws it (in_len, out_len, then ids, per request); the first num_prompts."""
    rng = random.Random(0)
    out = []
    for _ in range(W1_NUM_REQUESTS):
        in_len = rng.randint(100, 1024)
        out_len = rng.randint(100, 1024)
        ids = [rng.randint(100, 119999) for _ in range(in_len)]
        out.append(SampleRequest(ids, in_len, out_len, ids))
    # The totals pin the definition: a changed draw order would silently change the workload.
    assert sum(r.prompt_len for r in out) == W1_PROMPT_TOKENS
    assert sum(r.expected_output_len for r in out) == W1_OUTPUT_TOKENS
    assert (out[0].prompt_len, out[0].expected_output_len) == (964, 494)
    if num_prompts is not None:
        if not 1 <= num_prompts <= W1_NUM_REQUESTS:
            raise ValueError(f"--num-prompts for W1 must be between 1 and {W1_NUM_REQUESTS}, got {num_prompts}.")
        out = out[:num_prompts]
    return out


def w2_requests(num_prompts: int | None = None) -> list[SampleRequest]:
    """W2: per request in_len = randint(6000, 15000), out_len = randint(128, 512), then the ids from
    randint(100, 119999), all from random.Random(2); the first num_prompts."""
    rng = random.Random(2)
    out = []
    for _ in range(W2_NUM_REQUESTS):
        in_len = rng.randint(6000, 15000)
        out_len = rng.randint(128, 512)
        ids = [rng.randint(100, 119999) for _ in range(in_len)]
        out.append(SampleRequest(ids, in_len, out_len, ids))
    assert sum(r.prompt_len for r in out) == W2_PROMPT_TOKENS
    assert sum(r.expected_output_len for r in out) == W2_OUTPUT_TOKENS
    assert (out[0].prompt_len, out[0].expected_output_len) == (6926, 174)
    if num_prompts is not None:
        if not 1 <= num_prompts <= W2_NUM_REQUESTS:
            raise ValueError(f"--num-prompts for W2 must be between 1 and {W2_NUM_REQUESTS}, got {num_prompts}.")
        out = out[:num_prompts]
    return out


def write_w2_config(directory: str | None = None) -> str:
    """A model directory holding only W2's config.json: load it with load_format='dummy'."""
    path = directory or tempfile.mkdtemp(prefix="kvserve-w2-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(W2_CONFIG, f)
    return path


def _first_exchange(conversations) -> tuple[str, str] | None:
    """The first human turn and the gpt reply right after it."""
    for turn, reply in itertools.pairwise(conversations):
        if turn.get("from") == "human" and reply.get("from") == "gpt":
            return turn.get("value") or "", reply.get("value") or ""
    return None


def sharegpt_requests(path: str | os.PathLike, num_prompts: int, tokenizer, seed: int,
                      output_len: int | None = None) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: shuffle with the seed, prompt = first human turn, output length = the
    token length of the gpt reply (or output_len), skipping too short/long pairs."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"--dataset-path {str(path)!r} is not a file (a ShareGPT JSON list is expected; "
                         f"nothing is downloaded).")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of {{'conversations': [...]}} entries.")
    entries = [d for d in data if isinstance(d, dict) and len(d.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(entries)
    out = []
    for entry in entries:
        if len(out) >= num_prompts:
            break
        pair = _first_exchange(entry["conversations"])
        if pair is None:
            continue
        prompt, completion = pair
        prompt_ids = tokenizer(prompt).input_ids
        n_out = len(tokenizer(completion).input_ids) if output_len is None else output_len
        n_in = len(prompt_ids)
        too_short = n_in < SHAREGPT_MIN_LEN or (output_len is None and n_out < SHAREGPT_MIN_LEN)
        too_long = n_in > SHAREGPT_MAX_PROMPT_LEN or n_in + n_out > SHAREGPT_MAX_TOTAL_LEN
        if too_short or too_long:
            continue
        out.append(SampleRequest(prompt, n_in, n_out, list(prompt_ids)))
    if len(out) < num_prompts:
        raise ValueError(f"{path}: only {len(out)} usable conversations (after the length filter) for "
                         f"--num-prompts {num_prompts}.")
    return out


def write_w1_config(directory: str | None = None) -> str:
    """A model directory holding only W1's config.json: load it with load_format='dummy'."""
    path = directory or tempfile.mkdtemp(prefix="kvserve-w1-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(W1_CONFIG, f)
    return path


def default_num_prompts(dataset: str) -> int:
    if dataset in ("w1", "w2"):
        return W1_NUM_REQUESTS if dataset == "w1" else W2_NUM_REQUESTS
    return 1000  # vLLM's default for the others


def build_requests(dataset: str, *, num_prompts: int | None, input_len: int | None, output_len: int | None,
                   range_ratio: float = 0.0, prefix_len: int = 256, num_prefixes: int = 10,
                   dataset_path: str | None = None, seed: int = 0, vocab_size: int | None = None,
                   tokenizer=None) -> list[SampleRequest]:
    """One entry point for the CLI flags. vocab_size is needed by random/prefix, tokenizer by sharegpt."""
    if dataset not in DATASETS:
        raise ValueError(f"--dataset {dataset!r} is not one of {', '.join(DATASETS)}.")
    n = num_prompts if num_prompts is not None else default_num_prompts(dataset)
    if n < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {n}.")
    if dataset == "w1":
        if vocab_size is not None and vocab_size < W1_MIN_VOCAB:
            raise ValueError(f"W1 uses token ids up to 119999 but this model's vocabulary has {vocab_size}: "
                             f"run W1 on its Llama-3.1-8B shape (--model {W1_MODEL_ALIAS}).")
        return w1_requests(n)
    if dataset == "w2":
        if vocab_size is not None and vocab_size < W1_MIN_VOCAB:
            raise ValueError(f"W2 uses token ids up to 119999 but this model's vocabulary has {vocab_size}: "
                             f"run W2 on its Gemma-3 shape (kvserve.bench.datasets.write_w2_config).")
        return w2_requests(n)
    if dataset == "sharegpt":
        if dataset_path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE.json (a ShareGPT-format list).")
        if tokenizer is None:
            raise ValueError("--dataset sharegpt needs a tokenizer to measure prompt and reply lengths.")
        return sharegpt_requests(dataset_path, n, tokenizer, seed, output_len)
    if vocab_size is None:
        raise ValueError(f"--dataset {dataset} needs the vocabulary size (from the model or --tokenizer).")
    in_len = 1024 if input_len is None else input_len
    out_len = 128 if output_len is None else output_len
    if in_len < 1 or out_len < 1:
        raise ValueError(f"--input-len and --output-len must be >= 1, got {in_len} and {out_len}.")
    if dataset == "prefix":
        return prefix_requests(n, prefix_len, num_prefixes, in_len, out_len, range_ratio, vocab_size, seed)
    return random_requests(n, in_len, out_len, range_ratio, vocab_size, seed)
