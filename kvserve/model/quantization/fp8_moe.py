"""FP8 (e4m3) routed experts for `--quantization fp8` on an unquantized checkpoint: each expert's w13 and w2
are quantized at load with per-output-channel scales, as fp8.py quantizes a linear layer's weight.

Weight-only: the Triton grouped GEMM (kvserve/ops/fused_moe.py) streams the e4m3 weights and multiplies in the
activation dtype, applying the scales after the K loop (decode, where MoE layers are bound by reading the
weights, reads half the bytes of bf16); the CPU reference dequantizes per expert.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.moe import UnquantizedMoEMethod
from kvserve.model.quantization.fp8 import quantize_per_channel


def _quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3 [E, N, K], float32 scales [E, N]); one expert at a time bounds the fp32 temporaries."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        q[e], scale[e] = quantize_per_channel(w[e])
    return q, scale


class Fp8MoEMethod(UnquantizedMoEMethod):
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13", "w2"):
            q, scale = _quantize_experts(getattr(layer, f"{name}_weight").data)
            setattr(layer, f"{name}_weight", nn.Parameter(q, requires_grad=False))
            setattr(layer, f"{name}_weight_scale", nn.Parameter(scale, requires_grad=False))

    def scales(self, layer: nn.Module):
        return layer.w13_weight_scale, layer.w2_weight_scale
