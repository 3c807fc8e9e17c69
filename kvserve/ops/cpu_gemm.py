"""fp32 linear layers on the CPU through oneDNN with weights reordered once at load time.

torch's F.linear on the CPU calls MKL's sgemm, which re-packs the weight on every call and, on AMD CPUs,
does not take its AVX-512 paths; oneDNN with a weight reordered into its blocked layout up front is
1.3-1.7x faster on this model's shapes (both the prefill GEMMs and the small-batch decode GEMMs). Results
differ from sgemm's only in summation order (~1e-6 relative), like any other fp32 GEMM kernel.

KVSERVE_CPU_ONEDNN=0 turns it off (plain F.linear), e.g. to compare the two in one run.
"""

from __future__ import annotations

import os

import torch
from torch import nn

_BATCH_HINT = 32  # oneDNN picks the packed layout for this many rows; any row count works with it


def onednn_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def enabled() -> bool:
    return os.environ.get("KVSERVE_CPU_ONEDNN", "1") != "0" and onednn_linear_available()


class PackedLinearWeight:
    """A [out, in] fp32 weight in oneDNN's layout; `linear(x, bias)` computes F.linear(x, weight, bias)."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)
        self.out_features = weight.shape[0]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] == 0 or not x.is_contiguous():
            x = x.reshape(-1, x.shape[-1]).contiguous()
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def _fp32_cpu_weight(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.float32
            and weight.device.type == "cpu")


class PackedUnquantizedMethod:
    """Stands in for a layer's UnquantizedLinearMethod: same apply(), on the packed weight. The layer's own
    forward (e.g. a tensor-parallel all-reduce after the GEMM) is left as it is."""

    packs_for_cpu_gemm = False  # already packed

    def __init__(self, original):
        self.original = original

    def __getattr__(self, name):
        return getattr(self.original, name)

    def apply(self, layer, x, bias=None):
        out = layer.packed_weight.linear(x, bias)
        return out.view(*x.shape[:-1], out.shape[-1])


def pack_cpu_linears(model: nn.Module) -> int:
    """Route every fp32 CPU linear layer with an UnquantizedLinearMethod, and the LM head, through oneDNN
    (weights packed now, after loading). The method is swapped, not the layer's forward, so a tensor-parallel
    layer's all-reduce stays; quantized layers keep their own kernels. Returns how many layers were switched
    (0 when disabled or unavailable)."""
    # The model's classes say what may be packed (`packs_for_cpu_gemm`: the unquantized linear method, the
    # LM head), so this kernel module does not import the model.
    if not enabled():
        return 0
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "packs_for_cpu_gemm", False) and _fp32_cpu_weight(module):
            module.packed_weight = PackedLinearWeight(module.weight)
            module.quant_method = PackedUnquantizedMethod(module.quant_method)
            count += 1
        elif method is None and getattr(module, "packs_for_cpu_gemm", False) and _fp32_cpu_weight(module):
            # The logits GEMM (hidden x vocab, every decode step): the largest single weight. A tied head
            # keeps its weight for the embedding lookup; the packed copy is used by compute_logits only.
            module.packed_weight = PackedLinearWeight(module.weight)
            count += 1
    return count
