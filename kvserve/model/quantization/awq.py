"""AWQ checkpoints (AutoAWQ's GEMM format): 4-bit weights with per-group scales and zero points.

On disk, for a layer with K inputs and N outputs and group size g:
  qweight int32 [K, N / 8]  eight 4-bit values of one input row, output columns interleaved: field i of
                            element j holds column 8 j + AWQ_ORDER[i]
  qzeros  int32 [K / g, N / 8]  the same packing of the (unsigned, unoffset) zero points
  scales  float16 [K / g, N]
W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]; y = x @ W.
"""

from __future__ import annotations

import torch

from kvserve.model.linear_method import LinearMethodBase
from kvserve.model.quantization.base import QuantizationConfig, new_param, check_choice, check_divisible
from kvserve.model.quantization.int_weights import IntWeights, pack_rows, unpack_cols

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
SUPPORTED_GROUP_SIZES = (32, 64, 128)


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, bits: int, group_size: int, zero_point: bool, version: str, modules_to_not_convert: list[str]):
        check_choice("bits (w_bit)", bits, (4,), "awq")
        check_choice("group_size (q_group_size)", group_size, SUPPORTED_GROUP_SIZES, "awq")
        if not zero_point:
            raise ValueError("awq: zero_point=False checkpoints are not supported (supported: zero_point=True).")
        check_choice("version", version.lower(), ("gemm",), "awq")
        self.bits, self.group_size = bits, group_size
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.bits_per_weight = bits + 16 * 2 / group_size  # scales, and zeros unpacked after load

    @classmethod
    def from_config(cls, q: dict) -> "AWQConfig":
        return cls(
            bits=int(q.get("bits", q.get("w_bit", 4))),
            group_size=int(q.get("group_size", q.get("q_group_size", 128))),
            zero_point=bool(q.get("zero_point", True)),
            version=str(q.get("version", "gemm")),
            modules_to_not_convert=q.get("modules_to_not_convert") or [],
        )

    def get_quant_method(self, prefix):
        if self.skipped(prefix, self.modules_to_not_convert):
            return None
        return AWQLinearMethod(self, prefix)


class AWQLinearMethod(LinearMethodBase):
    def __init__(self, cfg: AWQConfig, prefix: str = ""):
        self.cfg, self.prefix = cfg, prefix

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        g, pack = self.cfg.group_size, 32 // self.cfg.bits
        k, n = input_size_per_partition, sum(output_partition_sizes)
        check_divisible("awq", self.prefix, "input size", k, g, f"group_size {g}")
        for part in output_partition_sizes:
            check_divisible("awq", self.prefix, "output size", part, pack, f"{pack} values per int32")
        packed = dict(input_dim=0, output_dim=1, packed_dim=1, pack_factor=pack)
        layer.register_parameter("qweight", new_param((k, n // pack), torch.int32, **packed,
                                                      format_hint="awq qweight: int32 [in, out/8]"))
        layer.register_parameter("qzeros", new_param((k // g, n // pack), torch.int32, **packed,
                                                     format_hint=f"awq qzeros: int32 [in/{g}, out/8]"))
        layer.register_parameter("scales", new_param((k // g, n), params_dtype, input_dim=0, output_dim=1,
                                                     format_hint=f"awq scales: [in/{g}, out]"))

    def process_weights_after_loading(self, layer):
        bits = self.cfg.bits
        q = unpack_cols(layer.qweight.data, bits, AWQ_ORDER)
        zeros = unpack_cols(layer.qzeros.data, bits, AWQ_ORDER)
        IntWeights.install(layer, bits, pack_rows(q, bits), layer.scales.data, zeros.to(layer.scales.dtype), None,
                           self.cfg.group_size)

    def apply(self, layer, x, bias=None):
        return IntWeights.apply(layer, x, bias)
