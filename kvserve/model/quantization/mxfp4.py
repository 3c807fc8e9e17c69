"""MXFP4 checkpoints (gpt-oss): the routed experts' weights in OCP microscaling FP4, dequantized at load.

The layout HF's gpt-oss checkpoints store (transformers/integrations/mxfp4.py reads it the same way): a weight
[E, N, K] (N output features, K inputs) is `<name>_blocks` uint8 [E, N, K / 32, 16] and `<name>_scales` uint8
[E, N, K / 32]. Each group of 32 inputs is 16 bytes of E2M1 values, two per byte (the low nibble is the
even input, the high nibble the odd one), times 2 ** (scale - 127), the group's E8M0 exponent.

kvserve has no MXFP4 GEMM yet: the experts are served in the model dtype (bf16), which takes about four times
the memory of the checkpoint's experts. Every other layer of these checkpoints is unquantized.
"""

from __future__ import annotations

import torch

from kvserve.model.quantization.base import QuantizationConfig

# E2M1: sign bit, then 2 exponent bits and 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # inputs per scale
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up: "
                         f"blocks must be [..., G, {GROUP // 2}] with scales [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = torch.ldexp(values.flatten(-2), scales.to(torch.int32)[..., None] - SCALE_BIAS)
    return values.flatten(-2).to(dtype)


class Mxfp4Config(QuantizationConfig):
    """Dequantizes at load: every layer gets the unquantized method; the model's loader (gpt_oss.py) pairs
    each `_blocks` tensor with its `_scales` and hands over the dequantized weight."""

    name = "mxfp4"
    bits_per_weight = 16.0  # served dequantized

    def get_quant_method(self, prefix: str):
        return None

    def get_moe_method(self, prefix: str):
        return None

    @classmethod
    def from_config(cls, quant_cfg: dict) -> "Mxfp4Config":
        return cls()
