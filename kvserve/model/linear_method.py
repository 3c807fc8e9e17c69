"""How a linear layer holds and applies its weights: the hook quantization methods plug into.

A linear layer never creates its weight itself; its method does (`create_weights`), tagging each
Parameter with how checkpoint tensors map onto it (`output_dim`, `input_dim`, `packed_dim` +
`pack_factor`), so the layer's weight_loader can cut this rank's tensor-parallel slice for any method.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def set_weight_attrs(param: nn.Parameter, attrs: dict) -> None:
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


class LinearMethodBase:
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every weight is loaded (repacking, transposes, quantizing a float checkpoint)."""


class UnquantizedLinearMethod(LinearMethodBase):
    """weight [out_per_partition, in_per_partition] in the serving dtype; y = x W^T (+ b)."""

    packs_for_cpu_gemm = True  # ops/cpu_gemm.py may swap it for its oneDNN-packed twin

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)
