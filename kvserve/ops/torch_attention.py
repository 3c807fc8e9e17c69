"""Paged attention in plain torch: the CPU path and the oracle for the Triton kernels.

`reference_attention` is the readable definition (one request at a time, every context read back from
the cache). `TorchAttentionBackend` computes the same thing with few, large tensor ops: the step's shape
(which requests decode, which prefill from scratch, every gather index and mask) is worked out once per
step in a `StepPlan` and reused by all layers, decodes run as one padded SDPA call, and prompts without
cached context attend to the step's own K/V with a causal SDPA, consecutive equal-length prompts in one
batched call. tests/kernels/test_torch_attention.py checks the two agree.

Per-layer options (both functions): `sliding_window` W makes key j visible from query i iff i - W < j <= i
(only those keys are read, so blocks left of every query's window may have been freed), and
`logits_soft_cap` C replaces each score s (already scaled) by C * tanh(s / C) before the softmax (Gemma 2),
and `sinks` ([H] float, gpt-oss) adds exp(sinks[h]) to each softmax denominator of head h: a virtual key
with that logit and a zero value, which takes a share of the attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.ops.attention_metadata import AttentionMetadata
from kvserve.ops.fp8_e4m3 import FP8_MAX


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
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, first: int = 0):
    """K and V of requests' positions first..seq_len-1: block_tables [B, nb] -> [B, seq_len - first, Hkv, D]
    each (an fp8 cache is dequantized to `dtype` with the per-tensor scales). Blocks wholly before `first`
    are not read."""
    block_size = kv_cache.shape[2]
    first_block = first // block_size
    num_blocks = -(-seq_len // block_size)
    tables = block_tables[:, first_block:num_blocks].long()
    shape = (tables.shape[0], (num_blocks - first_block) * block_size, *kv_cache.shape[3:])
    lo, hi = first - first_block * block_size, seq_len - first_block * block_size
    if is_fp8_cache(kv_cache):
        raw = kv_cache.view(torch.uint8)
        k = raw[0][tables].view(torch.float8_e4m3fn).reshape(shape)[:, lo:hi]
        v = raw[1][tables].view(torch.float8_e4m3fn).reshape(shape)[:, lo:hi]
        return (k.float() * k_scale.float()).to(dtype), (v.float() * v_scale.float()).to(dtype)
    return kv_cache[0][tables].reshape(shape)[:, lo:hi], kv_cache[1][tables].reshape(shape)[:, lo:hi]


def _explicit_attention(q, k, v, mask, scale, is_causal, soft_cap=None, sinks=None):
    """SDPA's maths over [B, H, Tq, D] x [B, H, S, D] with the scores capped and/or a sink logit per head
    ([H, 1], broadcast over the query rows; SDPA has hooks for neither), in fp32 as HF's eager attention
    computes it."""
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share is dropped
    return torch.matmul(probs, v.float()).to(q.dtype)


def _sdpa(q, k, v, mask, scale, is_causal=False, soft_cap=None, sinks=None):
    """q [B, Tq, H, D], k/v [B, S, Hkv, D], mask [B, 1, Tq, S] bool or None, sinks [H] or None."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if soft_cap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal,
                                             enable_gqa=q.shape[1] != k.shape[1])
    else:
        group = q.shape[1] // k.shape[1]  # GQA: each KV head serves `group` query heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = _explicit_attention(q, k, v, mask, scale, is_causal, soft_cap,
                                  None if sinks is None else sinks.view(-1, 1, 1))
    return out.transpose(1, 2)


def visible_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[Tq, S] bool: key j is visible from query i iff j <= i (and i - window < j with a window)."""
    mask = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
    return mask


def window_start(first_query_pos: int, sliding_window: int | None) -> int:
    """The first key position any query at or after first_query_pos can see."""
    return 0 if sliding_window is None else max(0, first_query_pos - sliding_window + 1)


def reference_attention(q, k, v, kv_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None,
                        sliding_window: int | None = None, logits_soft_cap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: write the step's K/V, then each request's queries attend causally to its context
    as read back from the cache (query j of a request sits at position seq_len - q_len + j); with a window,
    only the keys inside it are read."""
    write_kv_cache(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
    qsl = meta.query_start_loc_cpu.tolist()
    seq_lens = meta.seq_lens_cpu.tolist()
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens):
        q_len = qsl[i + 1] - qsl[i]
        if q_len == 0:
            continue
        first = window_start(seq_len - q_len, sliding_window)
        keys, values = gather_context(kv_cache, meta.block_tables[i:i + 1], seq_len, q.dtype, k_scale, v_scale,
                                      first=first)
        query_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
        mask = visible_keys(query_pos, torch.arange(first, seq_len, device=q.device), sliding_window)[None, None]
        out[qsl[i]:qsl[i + 1]] = _sdpa(q[qsl[i]:qsl[i + 1]].unsqueeze(0), keys, values, mask, scale,
                                       soft_cap=logits_soft_cap, sinks=sinks)[0]
    return out


def _slot_indices(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[B, nb] block ids -> [B, length] flat cache slots of positions 0..length-1 (padding reads block 0)."""
    nb = -(-length // block_size)
    tables = block_tables[:, :nb].long()
    offsets = torch.arange(block_size, device=tables.device)
    return (tables[:, :, None] * block_size + offsets).reshape(tables.shape[0], nb * block_size)[:, :length]


class StepPlan:
    """Everything about one step's batch that does not depend on the layer (only on its window): built once
    per step and window."""

    def __init__(self, meta: AttentionMetadata, device: torch.device, sliding_window: int | None = None):
        qsl = meta.query_start_loc_cpu.tolist()
        seq_lens = meta.seq_lens_cpu.tolist()
        bs = meta.block_size
        num_reqs = len(seq_lens)
        q_lens = [qsl[i + 1] - qsl[i] for i in range(num_reqs)]
        self.num_tokens = qsl[-1]
        window = sliding_window

        # Decodes: one query each, keys padded to the longest context, all in one SDPA call. Their K/V are
        # gathered by whole blocks (a few 12 KB copies per request instead of one small copy per position).
        decodes = [i for i in range(num_reqs) if q_lens[i] == 1]
        self.all_decode = len(decodes) == num_reqs and num_reqs > 0
        self.decode_tokens = None
        self.decode_blocks = self.decode_mask = None
        if decodes:
            rows = torch.tensor(decodes, device=device)
            self.decode_tokens = torch.tensor([qsl[i] for i in decodes], device=device)
            lens = [seq_lens[i] for i in decodes]
            max_s = max(lens)
            if window is None or max_s <= window:
                self.decode_blocks = meta.block_tables[rows, :-(-max_s // bs)].long().reshape(-1)
                if min(lens) != max_s:
                    lens_t = torch.tensor(lens, device=device)
                    self.decode_mask = (torch.arange(max_s, device=device)[None, :] < lens_t[:, None])[:, None, None, :]
                self.decode_shape = (len(decodes), max_s)
            else:
                # Only the blocks of each window: request r reads blocks first[r] .. first[r] + nb - 1 (past
                # its last block, its last block again: finite values, masked out).
                first = [window_start(n - 1, window) // bs for n in lens]
                last = [(n - 1) // bs for n in lens]
                nb = max(b - a + 1 for a, b in zip(first, last))
                idx = torch.tensor([[min(a + j, b) for j in range(nb)] for a, b in zip(first, last)], device=device)
                self.decode_blocks = meta.block_tables[rows[:, None], idx].long().reshape(-1)
                key_pos = (torch.tensor(first)[:, None] * bs + torch.arange(nb * bs)[None, :])
                lens_t = torch.tensor(lens)[:, None]
                visible = (key_pos < lens_t) & (key_pos > lens_t - 1 - window)
                self.decode_mask = visible[:, None, None, :].to(device)
                self.decode_shape = (len(decodes), nb * bs)

        # Prompts with no cached context: causal attention over the step's own K/V; runs of consecutive
        # requests with the same length go in one batched call (a window longer than the prompt is no mask).
        self.fresh_runs: list[tuple[int, int, int, torch.Tensor | None]] = []  # (first token, requests, length, mask)
        # Prompt chunks after cached context (chunked prefill, prefix hits): read back from the cache.
        self.context_chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (start, end, slots, mask)
        for i in range(num_reqs):
            q_len = q_lens[i]
            if q_len <= 1:
                continue
            if seq_lens[i] == q_len:
                last_run = self.fresh_runs[-1] if self.fresh_runs else None
                if last_run is not None and last_run[2] == q_len and last_run[0] + last_run[1] * q_len == qsl[i]:
                    self.fresh_runs[-1] = (last_run[0], last_run[1] + 1, q_len, last_run[3])
                else:
                    mask = None
                    if window is not None and q_len > window:
                        pos = torch.arange(q_len, device=device)
                        mask = visible_keys(pos, pos, window)[None, None]
                    self.fresh_runs.append((qsl[i], 1, q_len, mask))
            else:
                s = seq_lens[i]
                first = window_start(s - q_len, window)
                slots = _slot_indices(meta.block_tables[i:i + 1], s, bs).reshape(-1)[first:]
                query_pos = s - q_len + torch.arange(q_len, device=device)
                mask = visible_keys(query_pos, torch.arange(first, s, device=device), window)[None, None]
                self.context_chunks.append((qsl[i], qsl[i + 1], slots, mask))


class TorchAttentionBackend:
    def plan(self, meta: AttentionMetadata, device: torch.device, sliding_window: int | None = None) -> StepPlan:
        # The same metadata object reaches every layer of a step (of a KV cache group): plan on the first
        # layer of each window size, reuse after.
        plan = meta.backend_cache.get(sliding_window)
        if plan is None:
            plan = meta.backend_cache[sliding_window] = StepPlan(meta, device, sliding_window)
        return plan

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if is_fp8_cache(kv_cache):  # the definition dequantizes what it reads (fp8 KV on CPU: tests only)
            return reference_attention(q, k, v, kv_cache, meta, scale, k_scale, v_scale, sliding_window,
                                       logits_soft_cap, sinks)
        # Every K/V write of the layer happens before any read, so a request may read blocks that
        # another request of the same step is filling (prefix hits published this step).
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        plan = self.plan(meta, q.device, sliding_window)
        cap = logits_soft_cap
        if plan.all_decode and q.shape[0] == plan.num_tokens:
            return self._decode(q, kv_cache, plan, scale, cap, sinks)
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        key_cache = kv_cache[0].view(num_slots, *kv_cache.shape[3:])
        value_cache = kv_cache[1].view(num_slots, *kv_cache.shape[3:])
        out = torch.empty_like(q)
        if plan.decode_tokens is not None:
            out[plan.decode_tokens] = self._decode(q[plan.decode_tokens], kv_cache, plan, scale, cap, sinks)
        heads, head_dim = q.shape[1:]
        kv_heads = k.shape[1]
        for start, n, length, mask in plan.fresh_runs:
            end = start + n * length
            out[start:end] = _sdpa(
                q[start:end].view(n, length, heads, head_dim), k[start:end].view(n, length, kv_heads, head_dim),
                v[start:end].view(n, length, kv_heads, head_dim), mask, scale, is_causal=mask is None, soft_cap=cap,
                sinks=sinks,
            ).reshape(end - start, heads, head_dim)
        for start, end, slots, mask in plan.context_chunks:
            keys = key_cache.index_select(0, slots).unsqueeze(0)
            values = value_cache.index_select(0, slots).unsqueeze(0)
            out[start:end] = _sdpa(q[start:end].unsqueeze(0), keys, values, mask, scale, soft_cap=cap,
                                   sinks=sinks)[0]
        return out

    @staticmethod
    def _decode(q, kv_cache, plan: StepPlan, scale: float, soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, D] (one query per request) -> [B, H, D]."""
        b, s = plan.decode_shape
        kv_heads, head_dim = kv_cache.shape[3:]
        # [B * blocks, block_size, Hkv, D] -> [B, S, Hkv, D]: a strided view that skips the tail of the last block.
        keys = kv_cache[0].index_select(0, plan.decode_blocks).view(b, -1, kv_heads, head_dim)[:, :s]
        values = kv_cache[1].index_select(0, plan.decode_blocks).view(b, -1, kv_heads, head_dim)[:, :s]
        # The query heads that share a KV head become that head's query rows ([B, Hkv, H/Hkv, D]): SDPA's
        # rows need no causal mask here and the padding mask [B, 1, 1, S] broadcasts over them, which is
        # cheaper than SDPA's own GQA.
        q, keys, values = q.reshape(b, kv_heads, -1, head_dim), keys.transpose(1, 2), values.transpose(1, 2)
        if soft_cap is None and sinks is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.decode_mask, scale=scale)
        else:  # query head kvh * G + g is row g of KV head kvh: its sink goes with it
            out = _explicit_attention(q, keys, values, plan.decode_mask, scale, False, soft_cap,
                                      None if sinks is None else sinks.view(kv_heads, -1, 1))
        return out.reshape(b, -1, head_dim)
