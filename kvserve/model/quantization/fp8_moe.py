"""FP8 (e4m3) routed experts for `--quantization fp8` on an unquantized checkpoint: each expert's w13 and w2
are quantized at load with per-output-channel scales, as fp8.py quantizes a linear layer's weight.

How the Triton grouped GEMM (kvserve/ops/fused_moe.py) multiplies them is chosen from the step's token count
alone (no host syncs: the choice is fixed inside a CUDA graph). The whole rule is FP8_MOE_PATHS, whose kernels are:

* "w8a16": weight-only; the kernel converts the e4m3 weight tiles to the activation dtype.
* "w8a8": the activations quantized per token (per pair for the down projection, inside SiLU-and-mul) and
  e4m3 x e4m3 on the FP8 tensor cores, twice the bf16 MMA rate.
On the H200 W8A8 was the faster at every token count from 1 to 8,192 (`benchmarks/gpu_moe.py --sweep` times
both; BENCHMARKS.md, 2026-12-02, fifth run): even at one token, where both read the same fp8 bytes, converting
each weight tile costs more than quantizing x once. So the table is W8A8 throughout, as vLLM's fp8 experts are.
W8A8 needs FP8 tensor cores (compute capability >= 8.9; fp8.cuda_has_fp8); older GPUs stay weight-only at every
size. Triton's interpreter (TRITON_INTERPRET=1, CPU) runs the fp8 tl.dot exactly, so it follows the table too;
the plain CPU reference path (fused_moe_torch) is weight-only, as the dense FP8 layers are on CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from kvserve.model.moe import UnquantizedMoEMethod
from kvserve.model.quantization.fp8 import cuda_has_fp8
from kvserve.ops.fp8_e4m3 import quantize_per_channel


class Fp8MoEPath(NamedTuple):
    max_tokens: int  # serves a step of up to this many tokens (and more than the previous entry's)
    kernel: str  # "w8a16" (weight-only) or "w8a8"


FP8_MOE_PATHS: tuple[Fp8MoEPath, ...] = (
    Fp8MoEPath(1 << 62, "w8a8"),
)


def fp8_moe_path(tokens: int) -> Fp8MoEPath:
    return next(p for p in FP8_MOE_PATHS if tokens <= p.max_tokens)


def fp8_dot_available(w: torch.Tensor) -> bool:
    """Whether the fused-MoE kernel can multiply e4m3 by e4m3 where the weight w lives."""
    from kvserve.model.layers import use_fused_kernels

    return cuda_has_fp8(w.device) if w.is_cuda else use_fused_kernels(w)


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
        layer.fp8_dot = fp8_dot_available(layer.w13_weight)

    def scales(self, layer: nn.Module):
        return layer.w13_weight_scale, layer.w2_weight_scale

    def quantizes_activations(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return layer.fp8_dot and fp8_moe_path(x.shape[0]).kernel == "w8a8"


class Fp8CheckpointMoEMethod(Fp8MoEMethod):
    """Experts stored in e4m3 by the checkpoint (HF fp8 / AutoFP8: one float32 weight_scale per expert and
    projection; compressed-tensors: per tensor, or per output channel [N, 1]), loaded as they are: each scale is
    spread over its rows (FusedMoE.weight_loader), so the kernels are those of `--quantization fp8`. Activations are
    quantized per token; a static checkpoint's input_scale tensors are accepted and not used (per-token scales are
    at least as fine)."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       params_dtype: torch.dtype) -> None:
        fp8 = torch.float8_e4m3fn
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=fp8),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=fp8), requires_grad=False)
        layer.w13_weight_scale = nn.Parameter(torch.ones(num_experts, 2 * intermediate, dtype=torch.float32),
                                              requires_grad=False)
        layer.w2_weight_scale = nn.Parameter(torch.ones(num_experts, hidden, dtype=torch.float32),
                                             requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.fp8_dot = fp8_dot_available(layer.w13_weight)
