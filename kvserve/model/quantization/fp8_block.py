"""Block-wise FP8 checkpoints (`quant_method` fp8 with `weight_block_size` [bn, bk]: Qwen's own -FP8 releases,
DeepSeek-V3): each e4m3 weight [N, K] (or stacked [E, N, K]) carries `weight_scale_inv` [ceil(N/bn), ceil(K/bk)],
the factor of each bn x bk block (w = q * scale_inv; the name is the checkpoint format's).

kvserve has no block-scaled GEMM yet, so these weights are dequantized to the serving dtype as they are read:
the model then loads them as an unquantized checkpoint (every path, TP and expert parallelism included, is the
float one), at twice the checkpoint's weight bytes, which `kvserve plan` counts (memory_plan.checkpoint_weight_bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from kvserve.model.layers import as_tensor
from kvserve.model.quantization.base import QuantizationConfig
from kvserve.sizing.memory_plan import BLOCK_FP8_SCALE_SUFFIX as SCALE_SUFFIX
from kvserve.sizing.memory_plan import block_fp8_weights, checkpoint_tensors

logger = logging.getLogger(__name__)


class Fp8BlockConfig(QuantizationConfig):
    name = "fp8"
    bits_per_weight = 16.0  # served dequantized

    def __init__(self, block: tuple[int, int]):
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"fp8: weight_block_size {list(block)} is not [rows, columns] of positive sizes.")
        self.block = (int(block[0]), int(block[1]))

    def get_quant_method(self, prefix):
        return None

    def get_moe_method(self, prefix):
        return None

    def read_weights(self, weights: Iterable, model_path: Path, dtype: torch.dtype, device) -> Iterator:
        quantized = block_fp8_weights(checkpoint_tensors(model_path))
        logger.info("FP8 block-wise checkpoint (weight_block_size %s, %d tensors): dequantized to %s as read (no "
                    "block-scaled GEMM yet), so the weights take twice the checkpoint's bytes", list(self.block),
                    len(quantized), str(dtype).removeprefix("torch."))
        return dequantized_weights(weights, quantized, self.block, dtype, device)


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
                     ) -> torch.Tensor:
    """q e4m3 [..., N, K] times its bn x bk blocks' factors scale_inv [..., ceil(N/bn), ceil(K/bk)], in dtype."""
    bn, bk = block
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not match a weight of shape "
                         f"{tuple(q.shape)} in blocks of {bn} x {bk} (expected {want})")
    scale = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (q.float() * scale).to(dtype)


def dequantized_weights(weights: Iterable, quantized: set[str], block: tuple[int, int], dtype: torch.dtype,
                        device) -> Iterator:
    """The (name, tensor) stream with each weight named in `quantized` dequantized (on `device`) and its
    scale_inv consumed; the two may come in either order, from different shards."""
    waiting_weight: dict[str, torch.Tensor] = {}
    waiting_scale: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        base = name.removesuffix(SCALE_SUFFIX)
        if name.endswith(SCALE_SUFFIX) and base in quantized:
            scale = as_tensor(tensor).to(device)
            if base in waiting_weight:
                yield base, _dequantize(base, waiting_weight.pop(base), scale, block, dtype)
            else:
                waiting_scale[base] = scale
        elif name in quantized:
            q = as_tensor(tensor).to(device)
            if name in waiting_scale:
                yield name, _dequantize(name, q, waiting_scale.pop(name), block, dtype)
            else:
                waiting_weight[name] = q
        else:
            yield name, tensor
    if waiting_weight or waiting_scale:
        name = next(iter(waiting_weight or waiting_scale))
        raise ValueError(f"the checkpoint lists {name}{SCALE_SUFFIX} but lacks one of the pair; is every "
                         f"*.safetensors shard present?")


def _dequantize(name: str, q: torch.Tensor, scale: torch.Tensor, block, dtype) -> torch.Tensor:
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: a block-wise FP8 weight must be float8_e4m3fn, not {q.dtype}")
    try:
        return dequantize_block(q, scale, block, dtype)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
