"""One attention step over a random paged KV cache, shared by the attention backend tests: random q/k/v,
shuffled non-contiguous block tables padded with block 0, and garbage in every slot that is not part of a
context (so a read of the wrong slot shows up)."""

from __future__ import annotations

import random

import torch

from kvserve.ops.attention_metadata import AttentionMetadata


def make_batch(ctx_lens, q_lens, *, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, pad_tokens=0,
               pad_slots=False, qkv_views=False, seed=0, device="cpu"):
    """Random q/k/v for one step and a random paged cache (garbage everywhere, so any read of a slot that
    is not part of a context shows up), with shuffled, non-contiguous block tables padded with 0."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 * sum(blocks_per_req) + 3
    ids = list(range(1, num_blocks))  # block 0 = the tables' padding value, never handed out
    rnd.shuffle(ids)
    max_blocks = max(blocks_per_req) + 2
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, nb in enumerate(blocks_per_req):
        tables[i, :nb] = torch.tensor([ids.pop() for _ in range(nb)], dtype=torch.int32)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    slots = []
    for i, (c, s) in enumerate(zip(ctx_lens, seq_lens)):
        for p in range(c, s):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    num_actual = len(slots)
    if pad_slots:
        slots += [-1] * pad_tokens
    t = num_actual + pad_tokens
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=qsl,
        seq_lens=seq_t,
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_actual_tokens=num_actual,
        block_size=block_size,
        query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=seq_t.clone(),
    )
    h, hkv, d = num_heads, num_kv_heads, head_dim
    if qkv_views:  # as the model passes them: views of one fused qkv projection
        qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(device)  # the views stay views on the GPU
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
    else:
        q = torch.randn(t, h, d, generator=g)
        k = torch.randn(t, hkv, d, generator=g)
        v = torch.randn(t, hkv, d, generator=g)
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g)
    if device != "cpu":
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(meta, name, getattr(meta, name).to(device))
        q, k, v, kv_cache = (x.to(device) for x in (q, k, v, kv_cache))
    return q, k, v, kv_cache, meta


def poison_outside_window(kv_cache, meta, ctx_lens, window: int) -> None:
    """NaN into every block that lies wholly left of the step's first query's window (positions before
    ctx_len - window + 1): what the KV cache manager may have freed and given to another request."""
    bs = meta.block_size
    tables = meta.block_tables.cpu()
    for i, c in enumerate(ctx_lens):
        for b in range(max(0, c - window + 1) // bs):
            kv_cache[:, int(tables[i, b])] = float("nan")


def poison_past_sequence_ends(kv_cache, meta) -> None:
    """NaN into the slots of each request's last block past its sequence's end (unwritten: a whole-block read
    covers them)."""
    bs = meta.block_size
    tables = meta.block_tables.cpu()
    for i, seq_len in enumerate(meta.seq_lens.cpu().tolist()):
        if seq_len % bs:
            kv_cache[:, int(tables[i, seq_len // bs]), seq_len % bs:] = float("nan")


def dense_attention(q, k, v, kv_cache, meta, scale, ctx_lens, window=None, soft_cap=None, sinks=None):
    """The definition written from positions, independent of the backends' code: each request's context
    keys from the cache, then this step's K/V; key j visible from query i iff i - window < j <= i; with
    sinks [H], head h's softmax denominator also holds exp(sinks[h])."""
    import torch

    bs = meta.block_size
    tables = meta.block_tables.cpu()
    qsl = meta.query_start_loc.cpu().tolist()
    out = torch.zeros_like(q, dtype=torch.float32).cpu()
    group = q.shape[1] // k.shape[1]
    for i, c in enumerate(ctx_lens):
        a, b = qsl[i], qsl[i + 1]
        ctx_slots = [int(tables[i, p // bs]) * bs + p % bs for p in range(c)]
        flat_k = kv_cache[0].reshape(-1, *kv_cache.shape[3:]).cpu().float()
        flat_v = kv_cache[1].reshape(-1, *kv_cache.shape[3:]).cpu().float()
        keys = torch.cat([flat_k[ctx_slots], k[a:b].cpu().float()]).repeat_interleave(group, dim=1)
        values = torch.cat([flat_v[ctx_slots], v[a:b].cpu().float()]).repeat_interleave(group, dim=1)
        qpos = torch.arange(c, c + b - a)[:, None]
        kpos = torch.arange(c + b - a)[None, :]
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window is not None else True)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].cpu().float(), keys.nan_to_num(0.0)) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
            sink = torch.exp(sinks.cpu().float()[:, None, None] - scores.amax(dim=-1, keepdim=True))
            probs = weights / (weights.sum(dim=-1, keepdim=True) + sink)
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, values.nan_to_num(0.0))
    return out


class CountLaunches:
    """Stands in for a Triton kernel (monkeypatched over it), counts its launches and keeps the last one's
    keyword arguments."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.kwargs = kernel, 0, {}

    def __getitem__(self, grid):
        self.launches += 1

        def launch(*args, **kwargs):
            self.kwargs = kwargs
            return self.kernel[grid](*args, **kwargs)

        return launch


def long_prefill_backend(num_splits: int | None = None):
    """A Triton backend whose long-prefill threshold (16 tokens) these small batches reach; with num_splits, its
    decode-only batches split that many ways."""
    from kvserve.ops.triton_attention import TritonAttentionBackend

    backend = TritonAttentionBackend(num_sms=4)
    backend.LONG_PREFILL_MIN_QUERY = 16
    if num_splits:
        backend.choose_num_splits = lambda reqs, heads, max_query_len, *rest: num_splits if max_query_len == 1 else 1
    return backend
