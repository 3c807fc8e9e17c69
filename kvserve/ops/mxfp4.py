"""OCP microscaling FP4 (MXFP4), as gpt-oss's checkpoints store their experts, and its torch dequantization.

A weight [N, K] (N output features, K inputs) is held packed: `blocks` uint8 [N, K / 2] and `scales` uint8
[N, K / GROUP]. Byte j of a row holds inputs 2j (low nibble) and 2j + 1 (high nibble) as E2M1 (a sign bit, two
exponent bits, one mantissa bit: FP4_VALUES); each group of GROUP consecutive inputs is multiplied by
2 ** (scale - SCALE_BIAS), the group's E8M0 exponent. HF's checkpoints split the packed K into
[K / GROUP, GROUP / 2] (`_blocks` [..., N, K / 32, 16]); that is the same bytes.

The fused-MoE kernel (kvserve/ops/fused_moe.py) decodes these tiles itself; this is its reference and the
dequantization of every other path.
"""

from __future__ import annotations

import torch

from kvserve.sizing.memory_plan import MXFP4_GROUP as GROUP

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., K / 2] (or HF's [..., G, 16]), scales uint8 [..., G] with G = K / GROUP ->
    [..., K] in `dtype`."""
    groups = scales.shape[-1]
    if blocks.shape[-1] == GROUP // 2 and blocks.shape[:-1] == scales.shape:
        blocks = blocks.flatten(-2)
    if blocks.shape[:-1] != scales.shape[:-1] or blocks.shape[-1] != groups * GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up: "
                         f"blocks must be [..., G * {GROUP // 2}] (or [..., G, {GROUP // 2}]) with scales [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)  # [..., K]
    values = values.unflatten(-1, (groups, GROUP))
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - SCALE_BIAS)
    return values.flatten(-2).to(dtype)


def is_mxfp4(w: torch.Tensor) -> bool:
    """Whether a stacked expert weight is MXFP4-packed (its bytes, uint8) rather than float or e4m3."""
    return w.dtype == torch.uint8
