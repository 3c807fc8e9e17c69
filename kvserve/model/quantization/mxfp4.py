"""MXFP4 checkpoints (gpt-oss): the routed experts' weights in OCP microscaling FP4 (the format:
kvserve/ops/mxfp4.py), every other layer unquantized.

The experts are served as stored where the fused-MoE kernel can read them (CUDA, or Triton's interpreter) and
each rank's share of both GEMMs' inputs is whole groups of 32 (sizing/memory_plan.mxfp4_experts_packed): w13
[E, 2 * I, H / 2] and w2 [E, H, I / 2] bytes with their E8M0 scales, 4.25 bits a weight, decoded tile by tile
inside the grouped GEMM (kvserve/ops/fused_moe.py). Elsewhere (the CPU path; a tensor-parallel split that cuts a
group) they are dequantized to the serving dtype, at about four times the checkpoint's expert bytes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvserve.model.layers import use_fused_kernels
from kvserve.model.moe import UnquantizedMoEMethod
from kvserve.model.quantization.base import QuantizationConfig
from kvserve.ops.mxfp4 import GROUP, dequantize_mxfp4
from kvserve.sizing.memory_plan import mxfp4_experts_packed

logger = logging.getLogger(__name__)


class Mxfp4MoEMethod(UnquantizedMoEMethod):
    """layer.mxfp4_packed: the experts stay MXFP4 (weights uint8, scales uint8 in w13/w2_weight_scale); else
    they are created, and loaded, in the serving dtype."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       params_dtype: torch.dtype) -> None:
        layer.mxfp4_packed = mxfp4_experts_packed(hidden, intermediate)
        layer.mxfp4_serving_dtype = params_dtype
        if not layer.mxfp4_packed:
            logger.info("MXFP4 experts dequantized to %s: this rank's %d intermediate features are not whole "
                        "groups of %d", params_dtype, intermediate, GROUP)
            return super().create_weights(layer, num_experts, hidden, intermediate, params_dtype)

        def packed(rows: int, inputs: int, per_byte: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(num_experts, rows, inputs // per_byte, dtype=torch.uint8),
                                requires_grad=False)

        layer.w13_weight, layer.w13_weight_scale = packed(2 * intermediate, hidden, 2), packed(2 * intermediate,
                                                                                                  hidden, GROUP)
        layer.w2_weight, layer.w2_weight_scale = packed(hidden, intermediate, 2), packed(hidden, intermediate, GROUP)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.mxfp4_packed and not use_fused_kernels(layer.w13_weight):
            # The torch path would dequantize every expert in every step: once, here.
            for name in ("w13", "w2"):
                w = dequantize_mxfp4(getattr(layer, f"{name}_weight").data, getattr(layer, f"{name}_weight_scale").data,
                                     layer.mxfp4_serving_dtype)
                setattr(layer, f"{name}_weight", nn.Parameter(w, requires_grad=False))
                delattr(layer, f"{name}_weight_scale")
            layer.mxfp4_packed = False

    def scales(self, layer: nn.Module):
        return (layer.w13_weight_scale, layer.w2_weight_scale) if layer.mxfp4_packed else (None, None)


class Mxfp4Config(QuantizationConfig):
    """Only the routed experts are quantized; the model's loader (gpt_oss.py) pairs each `_blocks` tensor with its
    `_scales` and hands them over packed, or dequantized where the method serves the experts so."""

    name = "mxfp4"
    bits_per_weight = 16.0  # every linear layer but the experts
    experts_format = "mxfp4"  # what the plan counts for the experts (memory_plan.weights_format)

    def get_quant_method(self, prefix: str):
        return None

    def get_moe_method(self, prefix: str):
        return Mxfp4MoEMethod()

    @classmethod
    def from_config(cls, quant_cfg: dict) -> "Mxfp4Config":
        return cls()
