"""Build a model on its device and fill it: safetensors (HF directory), GGUF, or random (dummy)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from kvserve.model.llama import MODEL_REGISTRY
from kvserve.model.model_config import ModelConfig
from kvserve.ops.attention_backend import AttentionBackend

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def iter_safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"No *.safetensors files in {model_dir}; save the model with safe_serialization=True.")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _fill_dummy(model: torch.nn.Module, seed: int) -> None:
    # Small values keep activations finite through many layers, as real checkpoints do.
    # Drawn on the parameter's own device: an 8B model filled through the CPU would take minutes.
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        param.data.uniform_(-1e-2, 1e-2, generator=gen)


def load_model(
    cfg: ModelConfig,
    model_path: Path,
    load_format: str,
    dtype: str,
    device: str,
    backend: AttentionBackend,
    max_positions: int,
    seed: int = 0,
) -> torch.nn.Module:
    model_cls = MODEL_REGISTRY[cfg.architecture]
    torch_dtype = DTYPES[dtype]
    with torch.device(device):
        model = model_cls(cfg, backend, max_positions)
    # Parameters in the serving dtype; rotary caches stay fp32 (HF computes cos/sin in fp32 too).
    for param in model.parameters():
        param.data = param.data.to(torch_dtype)

    if load_format == "dummy":
        _fill_dummy(model, seed)
        return model.eval()
    if load_format == "gguf" or (load_format == "auto" and model_path.suffix == ".gguf"):
        from kvserve.model.gguf_loader import iter_gguf_weights

        weights = iter_gguf_weights(model_path)
    else:
        weights = iter_safetensors_weights(model_path)
    loaded = model.load_weights(weights)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint at {model_path} lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
    return model.eval()
