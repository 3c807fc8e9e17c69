"""compressed-tensors checkpoints as llm-compressor writes them ("quant_method": "compressed-tensors").

Supported: format "float-quantized" (or "naive-quantized" with float weights) with 8-bit float weights,
strategy "tensor" or "channel", symmetric; input activations absent (weight-only), dynamic per-token,
or static per-tensor. The config is read here directly; the "ignore" list names unquantized layers.
"""

from __future__ import annotations

from kvserve.model.quantization.base import QuantizationConfig, check_choice
from kvserve.model.quantization.fp8 import Fp8LinearMethod

_SUPPORTED = "format float-quantized, 8-bit float weights (strategy tensor or channel, symmetric)"


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"
    bits_per_weight = 8.0

    def __init__(self, weight_strategy: str, static_input: bool, ignore: list[str]):
        self.weight_strategy = weight_strategy
        self.static_input = static_input
        self.ignore = list(ignore)

    @classmethod
    def from_config(cls, q: dict) -> "CompressedTensorsConfig":
        fmt = q.get("format", "float-quantized")
        check_choice("format", fmt, ("float-quantized", "naive-quantized"), "compressed-tensors")
        groups = list((q.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors: {len(groups)} config_groups; supported: exactly one ({_SUPPORTED}).")
        group = groups[0]
        targets = group.get("targets") or ["Linear"]
        if targets != ["Linear"]:
            raise ValueError(f"compressed-tensors: targets {targets} are not supported (supported: [\"Linear\"]).")
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8 or not w.get("symmetric", True):
            raise ValueError(f"compressed-tensors: weights {w} are not supported (supported: {_SUPPORTED}; "
                             f"int4 / pack-quantized schemes: use an AWQ or GPTQ checkpoint).")
        check_choice("weight strategy", w.get("strategy"), ("tensor", "channel"), "compressed-tensors")
        a = group.get("input_activations")
        static_input = False
        if a is not None:
            if a.get("type") != "float" or a.get("num_bits") != 8:
                raise ValueError(f"compressed-tensors: input_activations {a} are not supported "
                                 f"(supported: none, or 8-bit float dynamic per token / static per tensor).")
            static_input = not a.get("dynamic", True)
            if static_input:
                check_choice("static input_activations strategy", a.get("strategy"), ("tensor",), "compressed-tensors")
        return cls(w["strategy"], static_input, q.get("ignore") or [])

    def get_quant_method(self, prefix):
        if self.skipped(prefix, self.ignore):
            return None
        return Fp8LinearMethod(checkpoint_is_fp8=True, weight_strategy=self.weight_strategy,
                               static_input=self.static_input)

    def get_moe_method(self, prefix):
        if self.skipped(prefix, self.ignore):
            return None
        from kvserve.model.quantization.fp8_moe import Fp8CheckpointMoEMethod

        return Fp8CheckpointMoEMethod()
