"""Reference paged attention in plain torch: the CPU path and the oracle for the Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.ops.attention_metadata import AttentionMetadata


FP8_MAX = 448.0  # float8_e4m3fn


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.element_size() == 1


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in e4m3 (clamped: e4m3fn has no infinity, an overflow would be NaN)."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    n = slot_mapping.shape[0]
    k, v = k[:n], v[:n]
    if is_fp8_cache(kv_cache):
        # Index writes into float8 tensors are not implemented on CPU: write the bytes.
        k, v = quantize_kv(k, k_scale).view(torch.uint8), quantize_kv(v, v_scale).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    kv_cache[0].view(num_slots, *kv_cache.shape[3:])[slot_mapping] = k
    kv_cache[1].view(num_slots, *kv_cache.shape[3:])[slot_mapping] = v


def gather_context(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int, dtype: torch.dtype | None = None,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
    """K and V of requests' first `seq_len` positions: block_tables [B, nb] -> [B, seq_len, Hkv, D] each
    (an fp8 cache is dequantized to `dtype` with the per-tensor scales)."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    tables = block_tables[:, :num_blocks].long()
    shape = (tables.shape[0], num_blocks * block_size, *kv_cache.shape[3:])
    if is_fp8_cache(kv_cache):
        raw = kv_cache.view(torch.uint8)
        k = raw[0][tables].view(torch.float8_e4m3fn).reshape(shape)[:, :seq_len]
        v = raw[1][tables].view(torch.float8_e4m3fn).reshape(shape)[:, :seq_len]
        return (k.float() * k_scale.float()).to(dtype), (v.float() * v_scale.float()).to(dtype)
    return kv_cache[0][tables].reshape(shape)[:, :seq_len], kv_cache[1][tables].reshape(shape)[:, :seq_len]


def _sdpa(q, k, v, mask, scale):
    """q [B, Tq, H, D], k/v [B, S, Hkv, D], mask [B, 1, Tq, S] bool."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


class TorchAttentionBackend:
    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None
                ) -> torch.Tensor:
        # Every K/V write of the layer happens before any read, so a request may read blocks that
        # another request of the same step is filling (prefix hits published this step).
        write_kv_cache(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
        scales = dict(dtype=q.dtype, k_scale=k_scale, v_scale=v_scale)
        qsl = meta.query_start_loc_cpu.tolist()
        seq_lens = meta.seq_lens_cpu.tolist()
        out = torch.empty_like(q)
        decodes = [i for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] == 1]
        if decodes:
            # All single-token queries at once, keys padded to the longest context.
            idx = torch.tensor(decodes, device=q.device)
            max_s = max(seq_lens[i] for i in decodes)
            keys, values = gather_context(kv_cache, meta.block_tables[idx], max_s, **scales)
            lens = torch.tensor([seq_lens[i] for i in decodes], device=q.device)
            mask = (torch.arange(max_s, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
            tok = torch.tensor([qsl[i] for i in decodes], device=q.device)
            out[tok] = _sdpa(q[tok].unsqueeze(1), keys, values, mask, scale).squeeze(1)
        for i in range(len(seq_lens)):
            q_len = qsl[i + 1] - qsl[i]
            if q_len <= 1:
                continue
            keys, values = gather_context(kv_cache, meta.block_tables[i:i + 1], seq_lens[i], **scales)
            query_pos = seq_lens[i] - q_len + torch.arange(q_len, device=q.device)
            mask = (torch.arange(seq_lens[i], device=q.device)[None, :] <= query_pos[:, None])[None, None]
            out[qsl[i]:qsl[i + 1]] = _sdpa(q[qsl[i]:qsl[i + 1]].unsqueeze(0), keys, values, mask, scale)[0]
        return out
