"""FP8 (e4m3) weights: W8A8 on GPUs with FP8 tensor cores, weight-only elsewhere.

Three ways in, one served layout (weight e4m3 [N, K] + per-output-channel float32 weight_scale [N]):
* ``--quantization fp8`` on a bf16/fp16/fp32 checkpoint: each weight is quantized at load with
  per-channel scales (max |w| of the row / 448; the e4m3 quantizers: kvserve/ops/fp8_e4m3.py).
* HF / AutoFP8 checkpoints (quantization_config.quant_method "fp8"): per-tensor weight_scale per checkpoint
  tensor (a merged qkv layer gets one per part; expanded to per-channel, which is exact).
* compressed-tensors "float-quantized" checkpoints (llm-compressor): per-tensor or per-channel scales
  (see compressed_tensors.py, which reuses this method).
Activations: dynamic per-token scales, or the checkpoint's static per-tensor input_scale.

On CUDA with compute capability >= 8.9 the GEMM is torch._scaled_mm (row-wise scales) on the FP8 tensor
cores, its activations quantized by one Triton kernel (kvserve/ops/fp8_quant.py), or already by the RMSNorm or
SiLU*mul kernel that produced them (fused_input_quant: an Fp8Activation arrives instead of a tensor); at
decode's few rows (fp8_matmul.py's table) a Triton W8A16 kernel streams the e4m3 weight against unquantized
activations instead (a static input scale is then unused). Elsewhere (CPU, and older GPUs, where this is logged once) the reference path dequantizes the
weight and multiplies in the activation dtype: weight-only FP8, activations are not quantized.
"""

from __future__ import annotations

import logging

import torch

from kvserve.model.linear_method import LinearMethodBase
from kvserve.model.quantization.base import QuantizationConfig, new_param, check_choice
from kvserve.ops.fp8_e4m3 import FP8_DTYPE, quantize_per_channel

logger = logging.getLogger(__name__)


_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


def load_per_tensor_scale(param, loaded, shard_id=None) -> None:
    """A scalar scale per checkpoint tensor; a merged layer keeps one slot per part (q/k/v, gate/up)."""
    from kvserve.model.layers import as_tensor

    value = as_tensor(loaded).float().reshape(-1)
    if value.numel() != 1:
        raise ValueError(f"per-tensor scale: checkpoint tensor has {value.numel()} values, expected 1")
    param.data[0 if shard_id is None else _SHARD_INDEX.get(shard_id, shard_id)] = value[0]


_fp8_support_logged = False


def cuda_has_fp8(device: torch.device) -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) and newer. Older GPUs fall back to weight-only FP8."""
    global _fp8_support_logged
    major, minor = torch.cuda.get_device_capability(device)
    ok = (major, minor) >= (8, 9)
    if not ok and not _fp8_support_logged:
        _fp8_support_logged = True
        logger.warning("FP8: GPU compute capability %d.%d < 8.9 has no FP8 tensor cores; falling back to weight-only "
                       "FP8 (weights dequantized to the activation dtype per GEMM; slower than W8A8).", major, minor)
    return ok


class Fp8Config(QuantizationConfig):
    name = "fp8"
    bits_per_weight = 8.0

    def __init__(self, checkpoint_is_fp8: bool, activation_scheme: str = "dynamic",
                 ignored_layers: list[str] | None = None, weight_strategy: str = "tensor"):
        check_choice("activation_scheme", activation_scheme, ("dynamic", "static"), "fp8")
        self.checkpoint_is_fp8 = checkpoint_is_fp8
        self.activation_scheme = activation_scheme
        self.weight_strategy = weight_strategy
        self.ignored_layers = list(ignored_layers or [])

    @classmethod
    def from_config(cls, q: dict) -> "Fp8Config":
        if q.get("weight_block_size") is not None:
            from kvserve.model.quantization.fp8_block import Fp8BlockConfig

            return Fp8BlockConfig(q["weight_block_size"],
                                  q.get("ignored_layers") or q.get("modules_to_not_convert") or [])
        return cls(checkpoint_is_fp8=True, activation_scheme=str(q.get("activation_scheme", "dynamic")),
                   ignored_layers=q.get("ignored_layers") or q.get("modules_to_not_convert") or [])

    def get_quant_method(self, prefix):
        if self.skipped(prefix, self.ignored_layers):
            return None
        return Fp8LinearMethod(self.checkpoint_is_fp8, self.weight_strategy, self.activation_scheme == "static")

    def get_moe_method(self, prefix):
        if self.skipped(prefix, self.ignored_layers):
            return None
        from kvserve.model.quantization.fp8_moe import Fp8CheckpointMoEMethod, Fp8MoEMethod

        return Fp8CheckpointMoEMethod() if self.checkpoint_is_fp8 else Fp8MoEMethod()


class Fp8LinearMethod(LinearMethodBase):
    def __init__(self, checkpoint_is_fp8: bool, weight_strategy: str = "tensor", static_input: bool = False):
        check_choice("weight strategy", weight_strategy, ("tensor", "channel"), "fp8")
        self.checkpoint_is_fp8 = checkpoint_is_fp8
        self.weight_strategy = weight_strategy
        self.static_input = static_input

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        n, k = sum(output_partition_sizes), input_size_per_partition
        if not self.checkpoint_is_fp8:
            # A float checkpoint: quantized in process_weights_after_loading.
            layer.register_parameter("weight", new_param((n, k), params_dtype, output_dim=0, input_dim=1))
            return
        layer.register_parameter("weight", new_param((n, k), FP8_DTYPE, output_dim=0, input_dim=1,
                                                     format_hint="fp8 weight: float8_e4m3fn [out, in]"))
        parts = len(output_partition_sizes)
        if self.weight_strategy == "channel":
            scale = new_param((n, 1), torch.float32, output_dim=0, format_hint="fp8 weight_scale: float32 [out, 1]")
        else:
            scale = new_param((parts,), torch.float32, format_hint="fp8 weight_scale: float32 scalar per tensor",
                              weight_loader=load_per_tensor_scale)
        scale.data.fill_(1.0)
        layer.register_parameter("weight_scale", scale)
        if self.static_input:
            input_scale = new_param((parts,), torch.float32, format_hint="fp8 input_scale: float32 scalar per tensor",
                                    weight_loader=load_per_tensor_scale)
            input_scale.data.fill_(1.0)
            layer.register_parameter("input_scale", input_scale)

    def process_weights_after_loading(self, layer):
        w = layer.weight.data
        if not self.checkpoint_is_fp8:
            q, scale = quantize_per_channel(w)
        else:
            q = w
            scale = layer.weight_scale.data.float()
            if self.weight_strategy == "channel":
                scale = scale.reshape(-1)
            else:  # one scale per merged part -> per channel
                sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
                scale = torch.repeat_interleave(scale.reshape(-1), sizes)
        layer.weight = torch.nn.Parameter(q, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale.contiguous(), requires_grad=False)
        if self.static_input:
            # One scale for the layer's input: the largest of its parts' (they see the same input).
            layer.input_scale = torch.nn.Parameter(layer.input_scale.data.float().max().reshape(1), requires_grad=False)
        # _scaled_mm needs both GEMM dims of the weight in multiples of 16.
        layer.fp8_gemm = w.is_cuda and q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0 and cuda_has_fp8(w.device)

    def dequantized_weight(self, layer, dtype: torch.dtype) -> torch.Tensor:
        return (layer.weight.float() * layer.weight_scale[:, None]).to(dtype)

    def takes_fp8_input(self, layer, num_rows: int) -> bool:
        """Whether apply() would quantize an input of num_rows rows per token for torch._scaled_mm (by shape
        only, as apply chooses): then the kernel producing that input may hand over an Fp8Activation."""
        from kvserve.model.quantization.fp8_matmul import fp8_path

        return getattr(layer, "fp8_gemm", False) and fp8_path(num_rows).kernel == "scaled_mm"

    def apply(self, layer, x, bias=None):
        from kvserve.ops import fp8_quant

        if isinstance(x, fp8_quant.Fp8Activation):  # quantized by the kernel that produced it (fused_input_quant)
            out = self._scaled_mm(layer, x.q, x.scale, x.dtype)
            return out if bias is None else out + bias
        if not getattr(layer, "fp8_gemm", False):
            return torch.nn.functional.linear(x, self.dequantized_weight(layer, x.dtype), bias)
        from kvserve.model.quantization.fp8_matmul import fp8_path, weight_streaming_matmul

        x2 = x.reshape(-1, x.shape[-1])
        path = fp8_path(x2.shape[0])
        if path.kernel != "scaled_mm":
            # Decode: bound by reading the weight; stream the e4m3 weight against unquantized activations
            # (chosen by shape only, so a captured CUDA graph always replays the same kernel).
            out = weight_streaming_matmul(x2, layer.weight, layer.weight_scale, path)
        else:
            # One Triton kernel: quantized rows and their scales (per token, or the static input scale).
            xq, x_scale = fp8_quant.quantize_per_token(x2, layer.input_scale if self.static_input else None)
            out = self._scaled_mm(layer, xq, x_scale, x.dtype)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    @staticmethod
    def _scaled_mm(layer, xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # Row-wise scaled GEMM on the FP8 tensor cores (bf16 out, the row-wise kernels' output type).
        return torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale.view(1, -1),
                                out_dtype=torch.bfloat16).to(dtype)


# Off: RMSNorm and SiLU*mul write 16-bit outputs and each FP8 linear quantizes its own input (an A/B knob for
# benchmarks/gpu_quant.py; the tokens are the same either way).
FUSE_ACTIVATION_QUANT = True


def fused_input_quant(linear, num_rows: int) -> tuple[bool, torch.Tensor | None]:
    """For the kernel that produces `linear`'s input of num_rows rows: (quantize the output per token for it,
    the static input scale or None). True only for an FP8 linear on its torch._scaled_mm path."""
    method = getattr(linear, "quant_method", None)
    if not FUSE_ACTIVATION_QUANT or not isinstance(method, Fp8LinearMethod) or not method.takes_fp8_input(linear, num_rows):
        return False, None
    return True, linear.input_scale if method.static_input else None
