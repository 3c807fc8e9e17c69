"""SmolLM2-135M, kvserve's embedded default model, as an HF safetensors checkpoint for engines that read only
HF directories (vLLM, in gpu_spec.py's part d).

The config and the tensors are those kvserve serves: kvserve's own GGUF reader gives the HF config and the
dequantised float32 weights under HF names (tests/quant_utils.py's `smollm2_weights`, which writes the tests'
SmolLM2 checkpoints too), cast here to `dtype` as kvserve casts them to its served dtype. The embeddings stay
tied (no lm_head.weight); the GGUF has no generation defaults, so there is no generation_config.json and
both engines see neutral ones; the tokenizer beside them is the one kvserve converts from the GGUF. Needs
torch, transformers, gguf and safetensors only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # tests.quant_utils, when a benchmark runs without PYTHONPATH=.
    sys.path.insert(0, REPO)


def write_checkpoint(path: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """config.json, model.safetensors and the tokenizer of the embedded SmolLM2 in `path`; returns `path`."""
    from tests.quant_utils import make_smollm2_checkpoint, smollm2_weights

    config, weights = smollm2_weights()
    served = ({**config, "torch_dtype": str(dtype).removeprefix("torch.")},
              {name: weight.to(dtype) for name, weight in weights.items()})
    return str(make_smollm2_checkpoint(Path(path), None, served))
