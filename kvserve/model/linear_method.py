"""How a linear layer holds and applies its weight: the hook that quantization (and tensor parallelism)
plug into. A layer never creates its own weight; its method registers the parameters it needs, each
tagged with how a checkpoint tensor maps onto it, so one weight_loader serves every method."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def set_weight_attrs(param: nn.Parameter, **attrs) -> None:
    """Loading attributes of a parameter: output_dim / input_dim (the dims indexed by output / input
    features, or None), packed_dim + pack_factor (that dim holds pack_factor values per element)."""
    for key, value in attrs.items():
        setattr(param, key, value)


def new_param(shape, dtype, **attrs) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, **{"output_dim": None, "input_dim": None, **attrs})
    return param


class LinearMethodBase:
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        weight = new_param((sum(output_partition_sizes), input_size_per_partition), params_dtype,
                           output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)
