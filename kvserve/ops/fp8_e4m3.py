"""FP8 (e4m3fn) in torch: its limits and the reference quantizers, for every FP8 path (dense linears, experts,
the KV cache, the Triton kernels' constants). Needs no Triton: the CPU reference paths use it.

Scales are dynamic: max |row| / 448, at least MIN_SCALE (an all-zero row quantizes to zeros, not NaN).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448; e4m3fn has no infinity: values are clamped to it
MIN_SCALE = 1e-12


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 scale [N]) with w ~= q * scale[:, None]."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], float32 scale [..., 1]) with x ~= q * scale: one scale per row."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
