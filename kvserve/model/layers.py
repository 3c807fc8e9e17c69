"""Model building blocks. Linear layers are our own classes with a weight loader per parameter, so
quantized or tensor-parallel variants can replace them without touching the model code."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.linear_method import UnquantizedLinearMethod, new_param


# Fused Triton kernels run on CUDA, and on the CPU under Triton's interpreter (how CI tests them).
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_fused_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda or _TRITON_INTERPRET


class LinearBase(nn.Module):
    """y = x W^T (+ b). The weight's parameters come from the layer's quant_method (unquantized, fp8,
    int4, ...); world size 1 today: column/row parallel variants shard them here later.
    `prefix` is the layer's checkpoint name (without "model."), so a quantization config can skip layers."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant_config=None,
                 prefix: str = "", output_partition_sizes: list[int] | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.output_partition_sizes = list(output_partition_sizes or [out_features])
        self.prefix = prefix
        self.params_dtype = torch.get_default_dtype()
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, self.output_partition_sizes, in_features,
                                         out_features, self.params_dtype)
        if bias:
            self.bias = new_param((out_features,), self.params_dtype, output_dim=0)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def _shard_target(self, param: nn.Parameter, shard_id: int | None) -> torch.Tensor:
        """The region of `param` that checkpoint shard `shard_id` (of a merged layer) fills."""
        if shard_id is None:
            return param.data
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            # Per-tensor values: one slot per merged part when the method made room for it, else shared.
            if param.dim() == 1 and param.shape[0] == len(self.output_partition_sizes) > 1:
                return param.data[shard_id:shard_id + 1]
            return param.data
        offset = sum(self.output_partition_sizes[:shard_id])
        size = self.output_partition_sizes[shard_id]
        if getattr(param, "packed_dim", None) == output_dim:
            offset //= param.pack_factor
            size //= param.pack_factor
        return param.data.narrow(output_dim, offset, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        target = self._shard_target(param, shard_id)
        if target.numel() == 1 and loaded.numel() == 1:
            loaded = loaded.reshape(target.shape)
        if target.shape != loaded.shape:
            where = "" if shard_id is None else f" (shard {shard_id})"
            hint = getattr(param, "format_hint", None)
            raise ValueError(f"{self.prefix or type(self).__name__}: checkpoint tensor of shape {tuple(loaded.shape)} "
                             f"does not match parameter {tuple(target.shape)}{where}"
                             + (f"; expected layout {hint}" if hint else ""))
        target.copy_(_checkpoint_tensor_as(loaded, target.dtype, self.prefix))


_SERVING_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _checkpoint_tensor_as(loaded: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """Float weights go to the serving dtype; quantized tensors (packed int32, fp8) are taken as they
    are: a cast would destroy them, so a dtype mismatch there is a corrupt or mislabelled checkpoint."""
    if loaded.dtype == dtype or (loaded.dtype in _SERVING_FLOATS and dtype in _SERVING_FLOATS):
        return loaded.to(dtype)
    raise ValueError(f"{name}: checkpoint tensor has dtype {loaded.dtype}, but the layer's quantization "
                     f"method expects {dtype}; is --quantization right for this checkpoint?")


class ColumnParallelLinear(LinearBase):
    pass


class RowParallelLinear(LinearBase):
    pass


class MergedColumnLinear(LinearBase):
    """Several projections of the same input in one GEMM (gate+up); shard_id = index of the part."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False, quant_config=None,
                 prefix: str = ""):
        super().__init__(in_features, sum(part_sizes), bias, quant_config, prefix, output_partition_sizes=part_sizes)
        self.part_sizes = list(part_sizes)


class QKVLinear(MergedColumnLinear):
    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 quant_config=None, prefix: str = ""):
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias,
                         quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        super().weight_loader(param, loaded, self._SHARDS[shard_id])


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def weight_loader(self, param, loaded, shard_id=None):
        param.data.copy_(loaded)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`: returns (norm(x + residual), x + residual), the fused pre-norm pattern."""
        if use_fused_kernels(x):
            from kvserve.ops.fused_kernels import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)

    def weight_loader(self, param, loaded, shard_id=None):
        param.data.copy_(loaded)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half layout (HF's Llama convention), cos/sin cached in fp32."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind != "default":
            raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_cached", freqs.cos(), persistent=False)
        self.register_buffer("sin_cached", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, Hkv, D]; returns both rotated (in place on the fused path)."""
        if use_fused_kernels(q) and q.shape[-1] % 2 == 0:
            from kvserve.ops.fused_kernels import apply_rotary_

            return apply_rotary_(positions, q, k, self.cos_cached, self.sin_cached)
        cos = self.cos_cached[positions].unsqueeze(1)
        sin = self.sin_cached[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same op order and dtypes as HF (cos/sin cast to x's dtype), so bf16 results round alike.
    cos = torch.cat((cos, cos), dim=-1).to(x.dtype)
    sin = torch.cat((sin, sin), dim=-1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
