"""Model building blocks. Linear layers are our own classes with a weight loader per parameter, so
quantized or tensor-parallel variants can replace them without touching the model code."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn


# Fused Triton kernels run on CUDA, and on the CPU under Triton's interpreter (how CI tests them).
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_fused_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda or _TRITON_INTERPRET


class LinearBase(nn.Module):
    """y = x W^T (+ b). World size 1 today; column/row parallel variants shard `weight` here later."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
        param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    pass


class RowParallelLinear(LinearBase):
    pass


class MergedColumnLinear(LinearBase):
    """Several projections of the same input in one GEMM (gate+up); shard_id = index of the part."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(part_sizes), bias)
        self.part_sizes = list(part_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset = sum(self.part_sizes[:shard_id])
        size = self.part_sizes[shard_id]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shard {shard_id}: shape {tuple(loaded.shape)} != {tuple(target.shape)}")
        target.copy_(loaded)


class QKVLinear(MergedColumnLinear):
    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)

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
        self._step_positions: torch.Tensor | None = None
        self._step_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, Hkv, D]; returns both rotated (in place on the fused path)."""
        if use_fused_kernels(q) and q.shape[-1] % 2 == 0:
            from kvserve.ops.fused_kernels import apply_rotary_

            return apply_rotary_(positions, q, k, self.cos_cached, self.sin_cached)
        # Every layer of a step gets the same positions tensor: look cos/sin up once per step.
        if self._step_positions is not positions:
            cos = self.cos_cached[positions].unsqueeze(1)
            sin = self.sin_cached[positions].unsqueeze(1)
            self._step_cos_sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            self._step_positions = positions
        cos, sin = self._step_cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same op order and dtypes as HF (cos/sin cast to x's dtype), so bf16 results round alike.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
