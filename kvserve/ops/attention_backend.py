"""The attention backend interface and the lookup from --attention-backend to an implementation."""

from __future__ import annotations

from typing import Protocol

import torch

from kvserve.ops.attention_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [1] float32: an fp8 (e4m3) cache stores k / k_scale
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,  # this layer's window: key j visible from query i iff i - W < j <= i
        logits_soft_cap: float | None = None,  # this layer's cap C: scores -> C * tanh(scores / C)
        sinks: torch.Tensor | None = None,  # [H] float32: head h's softmax denominator gains exp(sinks[h])
    ) -> torch.Tensor:  # [T, H, D]
        """Write this step's K/V into the cache at meta.slot_mapping, then attend causally over
        each request's context (cached blocks + this step's tokens; with a window only the keys inside it,
        and blocks wholly left of every query's window are never read). A one-byte cache dtype means
        FP8: K/V are quantized on write with the per-tensor scales and dequantized on read."""
        ...


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from kvserve.ops.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from kvserve.ops.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (choose torch or triton)")
