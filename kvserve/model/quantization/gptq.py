"""GPTQ checkpoints (AutoGPTQ / GPTQModel format): 4- or 8-bit weights, symmetric or asymmetric, with
optional act-order (desc_act: input rows grouped by g_idx rather than consecutively).

On disk, for K inputs, N outputs, pack = 32 // bits values per int32, G groups:
  qweight int32 [K / pack, N]   packed along the input: row k sits in bits (k % pack) * bits
  qzeros  int32 [G, N / pack]   packed along the output, sequentially; GPTQ v1 checkpoints store
                                zero - 1 (the historical offset), v2 ("checkpoint_format": "gptq_v2") the zero
  scales  float16 [G, N]
  g_idx   int32 [K]             group of each input row (G = K / group_size, or 1 for group_size -1)
W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]; y = x @ W.
"""

from __future__ import annotations

import torch

from kvserve.model.linear_method import LinearMethodBase
from kvserve.model.quantization.base import QuantizationConfig, new_param, check_choice, check_divisible
from kvserve.model.quantization.int_weights import IntWeights, unpack_cols

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str,
                 lm_head: bool = False, modules_to_not_convert: list[str] | None = None):
        check_choice("bits", bits, SUPPORTED_BITS, "gptq")
        check_choice("group_size", group_size, SUPPORTED_GROUP_SIZES, "gptq")
        check_choice("checkpoint_format", checkpoint_format, ("gptq", "gptq_v2"), "gptq")
        if lm_head:
            raise ValueError("gptq: a quantized lm_head (\"lm_head\": true) is not supported (supported: lm_head false).")
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.bits_per_weight = bits + (16 * 2 / group_size if group_size > 0 else 0)

    @classmethod
    def from_config(cls, q: dict) -> "GPTQConfig":
        return cls(
            bits=int(q.get("bits", 4)),
            group_size=int(q.get("group_size", 128)),
            desc_act=bool(q.get("desc_act", False)),
            sym=bool(q.get("sym", True)),
            checkpoint_format=str(q.get("checkpoint_format", "gptq")),
            lm_head=bool(q.get("lm_head", False)),
            modules_to_not_convert=q.get("modules_to_not_convert") or [],
        )

    def get_quant_method(self, prefix):
        if self.skipped(prefix, self.modules_to_not_convert):
            return None
        return GPTQLinearMethod(self, prefix)


class GPTQLinearMethod(LinearMethodBase):
    def __init__(self, cfg: GPTQConfig, prefix: str = ""):
        self.cfg, self.prefix = cfg, prefix

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        bits, g = self.cfg.bits, self.cfg.group_size
        pack = 32 // bits
        k, n = input_size_per_partition, sum(output_partition_sizes)
        check_divisible("gptq", self.prefix, "input size", k, pack, f"{pack} {bits}-bit values per int32")
        if g > 0:
            check_divisible("gptq", self.prefix, "input size", k, g, f"group_size {g}")
        for part in output_partition_sizes:
            check_divisible("gptq", self.prefix, "output size", part, pack, f"{pack} zero points per int32")
        groups = k // g if g > 0 else 1
        # Act-order with the input split over TP ranks (row-parallel): a rank's rows belong to any group,
        # so every rank keeps all groups' scales and zeros (g_idx, split with the rows, indexes them).
        group_dim = 0
        if self.cfg.desc_act and g > 0 and input_size != k:
            groups, group_dim = input_size // g, None
        layer.register_parameter("qweight", new_param(
            (k // pack, n), torch.int32, input_dim=0, output_dim=1, packed_dim=0, pack_factor=pack,
            format_hint=f"gptq {bits}-bit qweight: int32 [in/{pack}, out]"))
        layer.register_parameter("qzeros", new_param(
            (groups, n // pack), torch.int32, input_dim=group_dim, output_dim=1, packed_dim=1, pack_factor=pack,
            format_hint=f"gptq {bits}-bit qzeros: int32 [groups, out/{pack}]"))
        layer.register_parameter("scales", new_param((groups, n), params_dtype, input_dim=group_dim, output_dim=1,
                                                     format_hint="gptq scales: [groups, out]"))
        layer.register_parameter("g_idx", new_param((k,), torch.int32, input_dim=0, format_hint="gptq g_idx: int32 [in]"))
        layer.g_idx.data.copy_(torch.arange(k, dtype=torch.int32) // (g if g > 0 else k))

    def process_weights_after_loading(self, layer):
        bits, g = self.cfg.bits, self.cfg.group_size
        k = layer.g_idx.shape[0]
        groups = layer.scales.shape[0]
        g_idx = layer.g_idx.data
        if self.cfg.desc_act:
            if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
                raise ValueError(f"gptq: layer {self.prefix}: g_idx has groups outside [0, {groups}); "
                                 f"the checkpoint is corrupt.")
        else:
            g_idx = None  # consecutive groups: the kernels compute k // group_size
        zeros = unpack_cols(layer.qzeros.data, bits) + self.cfg.zero_offset
        IntWeights.install(layer, bits, layer.qweight.data, layer.scales.data, zeros.to(layer.scales.dtype), g_idx,
                           g if g > 0 else k)

    def apply(self, layer, x, bias=None):
        return IntWeights.apply(layer, x, bias)
