"""The in-run baseline: HF transformers `generate` on the same requests, in static left-padded batches.

Greedy with min_new_tokens = max_new_tokens = the batch's longest output (HF cannot stop rows early
without EOS), but only each request's own output length is counted, as for kvserve.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from kvserve.bench.datasets import SampleRequest
from kvserve.config import EngineConfig

_PAD = 0  # any id works: padded positions are masked out


@dataclass
class HFResult:
    elapsed: float
    batch_size: int
    prompt_tokens: int
    output_tokens: int
    outputs: list[list[int]]  # each request's first expected_output_len generated ids


def load_hf_model(config: EngineConfig):
    """The model kvserve would load, as an HF model: same path, dtype and device (dummy = random init)."""
    import torch
    import transformers

    dtype = getattr(torch, config.dtype)
    path = config.model_path
    if path.is_file() and path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    elif config.args.load_format == "dummy":
        hf_config = transformers.AutoConfig.from_pretrained(path)
        with torch.device(config.device):  # build in place: an 8B model initialised on the host is slow
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(config.device).eval()


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _generate(model, prompts: list[list[int]], new_tokens: int, device: str):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[_PAD] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    seq = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=_PAD)
    return seq[:, width:].tolist()


def run_hf(config: EngineConfig, requests: list[SampleRequest], batch_size: int) -> HFResult:
    import torch

    if batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {batch_size}.")
    device = config.device
    model = load_hf_model(config)
    vocab = config.model_config.vocab_size
    warm = [random.Random(-1).randrange(vocab) for _ in range(16)]
    outputs, elapsed = [], 0.0
    try:
        with torch.no_grad():
            _generate(model, [warm], 4, device)  # first-call allocations and kernel selection stay out
            _sync(device)
            for start in range(0, len(requests), batch_size):
                batch = requests[start:start + batch_size]
                t = time.perf_counter()
                rows = _generate(model, [r.prompt_token_ids for r in batch],
                                 max(r.expected_output_len for r in batch), device)
                _sync(device)
                elapsed += time.perf_counter() - t
                outputs.extend(row[:r.expected_output_len] for row, r in zip(rows, batch))
    finally:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()  # kvserve sizes its KV cache from the free memory after this
    return HFResult(elapsed, batch_size, sum(r.prompt_len for r in requests),
                    sum(r.expected_output_len for r in requests), outputs)
