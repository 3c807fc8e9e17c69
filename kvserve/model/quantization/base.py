"""What every quantization method shares: its config object, and reading it from a checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.linear_method import LinearMethodBase, set_weight_attrs


def new_param(shape, dtype, **attrs) -> nn.Parameter:
    """A parameter tagged for the layers' weight loaders (output_dim / input_dim, packed_dim + pack_factor;
    both dims None: loaded as it is), plus format_hint, named in shape errors."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, {"output_dim": None, "input_dim": None, **attrs})
    return param


class QuantizationConfig:
    """One method's settings, read from config.json's quantization_config (or made for --quantization
    on an unquantized checkpoint). It hands each linear layer the method that creates and applies its
    parameters; layers it skips (lm_head, modules_to_not_convert) get None, i.e. unquantized."""

    name: str = ""
    # Bits a linear weight element costs in memory, scales and zeros included (sizing before load).
    bits_per_weight: float = 16.0

    def get_quant_method(self, prefix: str) -> LinearMethodBase | None:
        raise NotImplementedError

    def get_moe_method(self, prefix: str):
        """The method for a MoE layer's stacked routed experts (kvserve/model/moe.py's hook); None: unquantized."""
        raise ValueError(f"{self.name}: mixture-of-experts layers ({prefix}) cannot be served with {self.name} "
                         f"weights yet; use an unquantized checkpoint, optionally with --quantization fp8.")

    @classmethod
    def from_config(cls, quant_cfg: dict) -> "QuantizationConfig":
        raise NotImplementedError

    def read_weights(self, weights, model_path, dtype: torch.dtype, device):
        """The checkpoint's (name, tensor) stream as the model's loaders take it; a method whose tensors are
        converted as they are read (fp8_block.Fp8BlockConfig) returns another."""
        return weights

    def skipped(self, prefix: str, skip_list: list[str]) -> bool:
        # Checkpoints name q_proj/k_proj/...; our merged layers are qkv_proj/gate_up_proj.
        names = checkpoint_names(prefix)
        return any(s and any(n == s or n.endswith("." + s) or s in n.split(".") for n in names) for s in skip_list)


def checkpoint_names(prefix: str) -> list[str]:
    """The names a checkpoint may give the layer built at `prefix`: a merged layer (qkv, gate_up) is stored as
    its parts; each with and without the leading `model.`."""
    prefix = prefix.removeprefix("model.")
    for merged, parts in ((".qkv_proj", ("q_proj", "k_proj", "v_proj")), (".gate_up_proj", ("gate_proj", "up_proj"))):
        if prefix.endswith(merged):
            base = prefix[: -len(merged)]
            return [prefix] + [f"{base}.{p}" for p in parts] + [f"model.{base}.{p}" for p in parts]
    return [prefix, f"model.{prefix}"]


def check_choice(what: str, value, supported, method: str) -> None:
    if value not in supported:
        raise ValueError(
            f"{method}: {what} {value!r} is not supported (supported: {', '.join(str(s) for s in supported)})."
        )


def check_divisible(method: str, prefix: str, what: str, size: int, divisor: int, why: str) -> None:
    if size % divisor:
        raise ValueError(f"{method}: layer {prefix}: {what} {size} is not a multiple of {divisor} ({why}).")
