"""Multi-head latent attention (DeepSeek-V3) over a paged cache of latents, in torch, by decompression.

The cache holds per token one entry of kv_lora_rank + qk_rope_head_dim values: the normed latent c and the
rotated shared rope key k_pe (not per-head K/V). It lives in the usual [2, num_blocks, block_size, 1, D]
layout with D = (kv_lora_rank + qk_rope_head_dim) / 2: the K plane holds the entry's first half, the V plane
the second, so the block tables, swapping and prefix caching work unchanged and a token costs exactly its
entry. Each step writes its tokens' entries, then every request reads back its context's entries and
decompresses them with the layer's kv_b_proj into per-head k_nope and v (as HF transformers does each step);
the keys are [k_nope, k_pe] (k_pe shared by all heads), the queries [q_nope, q_pe].

Torch only, one request at a time (host loop over the step's requests: no CUDA graphs). Weight absorption
(attending in the latent space, which reads kv_lora_rank values a key instead of decompressing them) and a
Triton kernel are not built yet.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.ops.attention_metadata import AttentionMetadata
from kvserve.ops.torch_attention import gather_context, is_fp8_cache, visible_keys, write_kv_cache


def write_latents(entries: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """entries [T, kv_lora_rank + rope]: each token's entry, split across the cache's K and V planes."""
    half = kv_cache.shape[-1]
    write_kv_cache(entries[:, None, :half], entries[:, None, half:], kv_cache, slot_mapping)


def read_latents(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, kv_lora_rank + rope]: the entries of one request's positions 0..seq_len-1."""
    k, v = gather_context(kv_cache, block_table[None], seq_len)
    return torch.cat([k[0, :, 0], v[0, :, 0]], dim=-1)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, kv_lora_rank: int, v_head_dim: int,
                  decompress: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                  scale: float) -> torch.Tensor:
    """q_nope [T, H, nope], q_pe [T, H, rope] (rotated); entries [T, kv_lora_rank + rope] (this step's tokens);
    decompress: latents [S, kv_lora_rank] -> (k_nope [S, H, nope], v [S, H, v_dim]). Returns [T, H, v_dim]."""
    if is_fp8_cache(kv_cache):
        raise ValueError("an fp8 KV cache is not supported with multi-head latent attention yet; "
                         "use --kv-cache-dtype auto")
    write_latents(entries, kv_cache, meta.slot_mapping)
    qsl = meta.query_start_loc_cpu.tolist()
    seq_lens = meta.seq_lens_cpu.tolist()
    heads = q_nope.shape[1]
    q = torch.cat([q_nope, q_pe], dim=-1)
    out = q.new_zeros(q.shape[0], heads, v_head_dim)  # rows past the requests' tokens (padding) stay zero
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        context = read_latents(kv_cache, meta.block_tables[i], seq_len)
        k_nope, v = decompress(context[:, :kv_lora_rank])
        k_pe = context[:, None, kv_lora_rank:].expand(-1, heads, -1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        q_len = end - start
        mask, causal = None, False
        if q_len == seq_len:
            causal = q_len > 1
        elif q_len > 1:  # a chunk after cached context
            pos = torch.arange(seq_len, device=q.device)
            mask = visible_keys(pos[seq_len - q_len:], pos, None)
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, is_causal=causal, scale=scale)
        out[start:end] = o[0].transpose(0, 1)
    return out
