"""Paged attention in Triton: the GPU backend (``--attention-backend triton``).

Kernels, all launched without host syncs (grids are sized from python ints only, so a forward can be
captured in a CUDA graph):

* ``_reshape_and_cache_kernel``: one program per token of ``slot_mapping`` copies that token's K and V
  (all kv heads) into the paged cache; negative slots (CUDA-graph padding) are skipped. An FP8 cache is
  quantized in the same pass (k / k_scale to e4m3).
* ``_unified_attention_kernel``: mixed batches (prefill chunks with cached context, decodes). One
  program per (q tile, kv head), on a 1-D grid of ``num_q_tiles * Hkv`` with the kv head fastest, the
  requests in batch order and each one's tiles in reverse. A q tile is BLOCK_Q consecutive query tokens of
  one request; the M dimension of ``tl.dot`` packs those tokens times the GQA group of query heads sharing
  the program's kv head (row m = token m // G, head kvh * G + m % G, BLOCK_Q = BLOCK_M // G). Request i
  owns tile slots ``[qsl[i] // BLOCK_Q + i, qsl[i + 1] // BLOCK_Q + i + 1)``, its last tile first; that start
  index is strictly increasing in i, so a program finds its request by binary search over
  ``query_start_loc``, and there are at most ``T // BLOCK_Q + B`` slots (surplus ones return at once). Each
  program walks the request's keys in steps of TILE_N up to the causal limit of its last query (whole steps
  that every row sees without masks, then the masked rest), gathering K/V through the block table key by key
  (so TILE_N does not depend on the cache's block size), with a flash-attention online softmax in fp32 (exp2;
  without a cap the scale is applied after the row max, in the exponent's multiply-add). With KV_TMA (a 16-bit
  cache whose block size is a multiple of TILE_N, Hopper and later) each key step is one TMA copy of a block's
  rows instead: the steps then start at multiples of TILE_N, and in masked steps the V rows of keys no row may
  read (left of every window, past the last key: freed or unwritten slots, possibly NaN) are zeroed before the
  P @ V product.
* ``_decode_kernel`` + ``_combine_splits_kernel``: split-KV (flash-decoding) for decode-only batches with
  few requests and long contexts: grid ``(B, Hkv, num_splits)``, each split attends over a contiguous
  range of the context (the same inner loop) and writes its partial output, running max and sum; the
  combine kernel (grid ``(B, H)``) merges them. ``TritonAttentionBackend.choose_num_splits`` decides.
  Both kernels attend only requests of exactly one query token, so they also take the decodes of a long
  prefill step (a query of LONG_PREFILL_MIN_QUERY tokens or more) in a layer without a window; the unified
  kernel then skips those requests (SKIP_SINGLE_QUERIES) rather than give each a program of BLOCK_M rows.

Per-layer options, each a constexpr switch so a layer without them compiles to the code above:

* ``sliding_window`` W (HAS_WINDOW): key j is visible from query i iff ``i - W < j <= i``. Keys left of a
  tile's first query's window are never read (their blocks may have been freed and reused): the unified
  kernel walks ``[max(0, first - W + 1), causal limit)``: the keys that every row of the tile sees go
  unmasked, the rest masked by both bounds; a decode split covers only ``[max(0, seq_len - W), seq_len)``.
* ``logits_soft_cap`` C (SOFT_CAP): each scaled score s becomes ``C * tanh(s / C)`` before the softmax
  (Gemma 2); the kernels work in the log2 domain, so they cap with C * log2(e).
* ``sinks`` ([H] float32, HAS_SINKS; gpt-oss): head h's softmax denominator also holds ``exp(sinks[h])``,
  a virtual key of that logit and zero value. Added once per row after the last key (``_add_sink``: the
  running max becomes ``max(m, sink)``, acc and the sum rescale to it); split-KV decode adds it in the
  combine kernel instead, after the splits' partials are merged (and in the decode kernel when there is
  one split).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvserve.ops.attention_metadata import AttentionMetadata
from kvserve.ops.fp8_quant import e4m3_bits
from kvserve.ops.split_k import num_sms
from kvserve.ops.triton_attention_launch import TritonAttentionLaunch

_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    idx = tl.arange(0, BLOCK_HD)
    h = idx // HEAD_DIM
    d = idx % HEAD_DIM
    mask = idx < NUM_KV_HEADS * HEAD_DIM
    tok64 = tok.to(tl.int64)
    kx = tl.load(k_ptr + tok64 * stride_kt + h * stride_kh + d, mask=mask)
    vx = tl.load(v_ptr + tok64 * stride_vt + h * stride_vh + d, mask=mask)
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    if KV_FP8:  # e4m3 bytes of k / k_scale, v / v_scale (the cache is passed as uint8)
        kx = e4m3_bits(tl.math.div_rn(kx.to(tl.float32), tl.load(k_scale_ptr).to(tl.float32)))
        vx = e4m3_bits(tl.math.div_rn(vx.to(tl.float32), tl.load(v_scale_ptr).to(tl.float32)))
    tl.store(k_cache_ptr + dst, kx.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, vx.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_keys(
    acc, l_i, m_i, q, query_pos,
    k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, key_start, key_end, qk_scale, window, soft_cap,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    DOT_PREC: tl.constexpr, MASKED: tl.constexpr, KV_FP8: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr, k_desc=None, v_desc=None, key_floor=0, KV_TMA: tl.constexpr = False,
    ZERO_V: tl.constexpr = False,
):
    """Online-softmax attention of the rows of q ([BLOCK_M, HEAD_DIM_P]) over key positions
    [key_start, key_end) of one request. MASKED: mask keys >= key_end and causally by query_pos
    ([BLOCK_M]), and with HAS_WINDOW keys at or before query_pos - window; else the caller guarantees
    whole TILE_N tiles that every row may see. Scores are in the log2 domain (qk_scale includes log2(e),
    soft_cap is C * log2(e)); m_i stays -inf for rows that saw no key. KV_TMA loads whole TILE_N steps: with
    ZERO_V (MASKED only) the V rows of keys outside [key_floor, key_end) are zeroed, for slots that may hold NaN."""
    d = tl.arange(0, HEAD_DIM_P)
    n = tl.arange(0, TILE_N)
    for start in range(key_start, key_end, TILE_N):
        kpos = start + n
        if MASKED:
            k_ok = kpos < key_end
        else:
            k_ok = kpos >= 0  # all true
        if KV_TMA:
            # The tile lies in one cache block (TILE_N divides BLOCK_SIZE, tiles start at multiples of TILE_N).
            blk = tl.load(bt_row_ptr + start // BLOCK_SIZE)
            row = blk * BLOCK_SIZE + start % BLOCK_SIZE
            k = k_desc.load([row, kvh * HEAD_DIM])
            v = v_desc.load([row, kvh * HEAD_DIM])
        else:
            if HEAD_DIM_P == HEAD_DIM:
                kv_mask = k_ok[:, None]
            else:
                kv_mask = k_ok[:, None] & (d < HEAD_DIM)[None, :]
            if MASKED:
                phys = tl.load(bt_row_ptr + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            else:
                phys = tl.load(bt_row_ptr + kpos // BLOCK_SIZE).to(tl.int64)
            base = phys * stride_cb + (kpos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
            kv_off = base[:, None] + d[None, :]  # [TILE_N, HEAD_DIM_P], contiguous along d
            if MASKED or HEAD_DIM_P != HEAD_DIM:
                k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
                v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            else:
                k = tl.load(k_cache_ptr + kv_off)
                v = tl.load(v_cache_ptr + kv_off)
        if KV_FP8:  # the scales are folded into qk_scale and the output by the caller
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if KV_TMA and MASKED and ZERO_V:  # unseen slots (freed, past the last key) may hold NaN: 0 * NaN reaches acc
            v = tl.where((k_ok & (kpos >= key_floor))[:, None], v, 0.0)
        # Without a cap the scale is applied after the row max (qk_scale > 0), in one fused multiply-add.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        row_scale = qk_scale
        if SOFT_CAP:  # C * tanh(s / C), tanh(x) = 1 - 2 / (exp(2x) + 1) (finite at both ends); s is then scaled
            s = s * qk_scale
            s = soft_cap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * _LOG2E_C) / soft_cap) + 1.0))
            row_scale = 1.0
        if MASKED:
            visible = k_ok[None, :] & (kpos[None, :] <= query_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (kpos[None, :] > query_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * row_scale)
        if MASKED:  # a row may have seen no key yet: avoid -inf - -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s * row_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _add_sink(acc, l_i, m_i, sink):
    """The sink logit (log2 domain, [BLOCK_M]) as one more key with a zero value: rescale to the new max."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)  # 0 for a row that saw no key (m_i = -inf)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - m_new)


# Block-table width varies per step: not a specialization key, or each new width could compile anew.
@triton.jit(do_not_specialize=["num_reqs", "stride_bt"])
def _unified_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, k_scale_ptr, v_scale_ptr,
    sinks_ptr, num_reqs, qk_scale, window, soft_cap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_KV_HEADS: tl.constexpr, NUM_Q_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, SKIP_SINGLE_QUERIES: tl.constexpr, k_desc=None, v_desc=None,
    KV_TMA: tl.constexpr = False,
):
    # 1-D grid over (tile slot, kv head), kv head fastest (programs sharing a request's K/V run together).
    # Requests in batch order, each one's tiles in reverse: a request's later tiles see the most keys, and a
    # batch's earlier requests have the longest contexts (decodes, then the chunk of a prompt begun in an
    # earlier step, then new prompts), so the longest programs start first.
    pid = tl.program_id(0)
    kvh = pid % NUM_KV_HEADS
    slot = pid // NUM_KV_HEADS

    # The request of this slot: the last i with qsl[i] // BLOCK_Q + i <= slot (binary search).
    lo = num_reqs * 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= slot:
            lo = mid
        else:
            hi = mid - 1
    req = lo

    q_start = tl.load(qsl_ptr + req)
    q_end = tl.load(qsl_ptr + req + 1)
    q_len = q_end - q_start
    slots_end = q_end // BLOCK_Q + req + 1  # the request's slots: [q_start // BLOCK_Q + req, slots_end)
    q_first = (slots_end - 1 - slot) * BLOCK_Q  # first query (within the request) of the tile
    skip = (slot >= slots_end) | (q_first >= q_len)  # past the last request, or a surplus tile
    if SKIP_SINGLE_QUERIES:  # the decode kernel has attended them
        skip = skip | (q_len == 1)
    if skip:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # the request's queries sit at positions ctx_len .. seq_len - 1

    m = tl.arange(0, BLOCK_M)
    qi = q_first + m // NUM_Q_PER_KV
    head = kvh * NUM_Q_PER_KV + m % NUM_Q_PER_KV
    row_ok = (m // NUM_Q_PER_KV < BLOCK_Q) & (qi < q_len)
    query_pos = ctx_len + qi
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # Keys up to the causal limit of the tile's last query; those before the tile's first query are seen
    # by every row of the tile, so whole TILE_N tiles of them go without masks.
    key_end = tl.minimum(seq_len, ctx_len + q_first + BLOCK_Q)
    full_end = (ctx_len + q_first) // TILE_N * TILE_N
    bt_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    full_start = full_end * 0
    key_floor = full_end * 0  # keys below it: outside every row's window
    if HAS_WINDOW:
        # Keys before the first query's window are never read; those before the window of the tile's
        # last query are seen by some rows only (masked); whole TILE_N tiles after that, up to full_end,
        # by every row.
        first_pos = ctx_len + q_first
        last_pos = ctx_len + tl.minimum(q_first + BLOCK_Q, q_len) - 1
        key_floor = tl.maximum(first_pos - window + 1, 0)
        key_lo = key_floor
        if KV_TMA:  # every key step starts at a multiple of TILE_N; the keys before key_floor are masked
            key_lo = key_lo // TILE_N * TILE_N
        full_end = tl.maximum(full_end, key_lo)
        seen_by_all = tl.minimum(tl.maximum(last_pos - window + 1, key_lo), full_end)
        full_start = full_end - (full_end - seen_by_all) // TILE_N * TILE_N
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, query_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, key_lo, full_start, qk_scale,
            window, soft_cap, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P, DOT_PREC,
            True, KV_FP8, HAS_WINDOW, SOFT_CAP, k_desc, v_desc, key_floor, KV_TMA,
        )
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, query_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, full_start, full_end, qk_scale,
        window, soft_cap, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P, DOT_PREC,
        False, KV_FP8, HAS_WINDOW, SOFT_CAP, k_desc, v_desc, 0, KV_TMA,
    )
    tail_start = full_end
    if KV_TMA:
        # The keys of a TMA step past key_end are the request's own later keys (written before the kernel runs)
        # up to seq_len, and a step left of the window shares its block with a key in the window (not freed):
        # only the step that crosses seq_len may read NaN.
        tail_start = tl.maximum(full_end, tl.minimum(key_end, seq_len // TILE_N * TILE_N))
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, query_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, full_end, tail_start,
            qk_scale, window, soft_cap, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P,
            DOT_PREC, True, KV_FP8, HAS_WINDOW, SOFT_CAP, k_desc, v_desc, key_floor, KV_TMA,
        )
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, query_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, tail_start, key_end, qk_scale,
        window, soft_cap, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P, DOT_PREC,
        True, KV_FP8, HAS_WINDOW, SOFT_CAP, k_desc, v_desc, key_floor, KV_TMA, ZERO_V=True,
    )
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * _LOG2E_C
        acc, l_i = _add_sink(acc, l_i, m_i, sink)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
    qk_scale, window, soft_cap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, NUM_Q_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Decode-only batches: one program per (request, kv head, split of the context)."""
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + req)
    # One query token, or none (padding) or several (a mixed step's prefills: the unified kernel's).
    if tl.load(qsl_ptr + req + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + req)

    m = tl.arange(0, BLOCK_M)
    head = kvh * NUM_Q_PER_KV + m
    row_ok = m < NUM_Q_PER_KV
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    tok = q_start.to(tl.int64)
    q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)

    # The split's key range: the visible context (all of it, or the window's last keys) cut into
    # NUM_SPLITS pieces of whole TILE_N tiles.
    first_key = seq_len * 0
    if HAS_WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
    per_split = (seq_len - first_key + NUM_SPLITS - 1) // NUM_SPLITS
    per_split = (per_split + TILE_N - 1) // TILE_N * TILE_N
    key_start = first_key + split * per_split
    key_end = tl.minimum(key_start + per_split, seq_len)
    query_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # Whole tiles without masks, then the last partial tile (the query sees the whole context).
    full_end = tl.maximum(key_start, key_start + (key_end - key_start) // TILE_N * TILE_N)
    bt_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    # Every key of the range is inside the query's window: no window mask needed.
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, query_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, key_start, full_end, qk_scale,
        window, soft_cap, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P, DOT_PREC,
        False, KV_FP8, False, SOFT_CAP,
    )
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, query_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, full_end, key_end, qk_scale,
        window, soft_cap, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P, DOT_PREC,
        True, KV_FP8, False, SOFT_CAP,
    )
    if HAS_SINKS and NUM_SPLITS == 1:  # with splits, the combine kernel adds the sink
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * _LOG2E_C
        acc, l_i = _add_sink(acc, l_i, m_i, sink)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # Partials laid out [B, H, NUM_SPLITS, (HEAD_DIM_P)], contiguous.
        row = (req * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM_P + d[None, :], out, mask=row_ok[:, None])
        tl.store(part_m_ptr + row, m_i, mask=row_ok)
        tl.store(part_l_ptr + row, l_i, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, qsl_ptr, sinks_ptr,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) - q_start != 1:  # as in _decode_kernel
        return
    s = tl.arange(0, SPLITS_P)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, HEAD_DIM_P)
    row = (req * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + s
    m_s = tl.load(part_m_ptr + row, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + row, mask=s_ok, other=0.0)
    o_s = tl.load(part_out_ptr + row[:, None] * HEAD_DIM_P + d[None, :], mask=s_ok[:, None], other=0.0)
    m_max = tl.max(m_s, axis=0)  # finite: the first split always holds the first visible key
    sink_share = 0.0
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E_C
        m_max = tl.maximum(m_max, sink)
        sink_share = tl.exp2(sink - m_max)
    w = tl.exp2(m_s - m_max) * l_s  # empty splits: exp2(-inf) * 0 = 0
    out = tl.sum(o_s * w[:, None], axis=0) / (tl.sum(w, axis=0) + sink_share)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def tma_supported(device: torch.device) -> bool:
    """Whether the GPU has the Tensor Memory Accelerator (Hopper, compute capability 9, and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_tokens: int | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Write k/v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping (the first
    ``min(len(slot_mapping), num_tokens, T)`` tokens; negative slots are skipped). A one-byte cache is
    FP8 e4m3: k / k_scale and v / v_scale are stored."""
    n = min(slot_mapping.shape[0], k.shape[0], num_tokens if num_tokens is not None else k.shape[0])
    if n <= 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    assert kv_cache.stride(-1) == 1
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    kv_fp8 = kv_cache.element_size() == 1
    if kv_fp8:
        # FP8: quantized in the kernel, bit for bit as torch_attention.quantize_kv (fp8_quant.e4m3_bits
        # encodes with integer ops, so the interpreter checks the same code), stored as bytes.
        kv_cache = kv_cache.view(torch.uint8)
    else:
        k_scale = v_scale = slot_mapping  # unread
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_HD=_next_pow2(num_kv_heads * head_dim),
        BLOCK_SIZE=block_size, KV_FP8=kv_fp8,
    )


class TritonAttentionBackend(TritonAttentionLaunch):
    """Launches the kernels above with TritonAttentionLaunch's settings. ``split_kv``: None chooses by the
    heuristic below, True forces the split-KV path for decode-only batches, False never uses it. ``num_splits``
    overrides the number of splits when the path is taken. ``num_sms`` defaults to the current CUDA device's
    (132 on an H200; 132 where there is no GPU)."""

    def __init__(self, split_kv: bool | None = None, num_splits: int | None = None, num_sms: int | None = None):
        self.split_kv = split_kv
        self.forced_num_splits = num_splits
        self._num_sms = num_sms

    @property
    def num_sms(self) -> int:
        if self._num_sms is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            self._num_sms = num_sms(device)
        return self._num_sms

    def choose_num_splits(self, num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                          head_dim: int = 128) -> int:
        """1 = no split-KV. Split only decode-only batches; by default only when B * Hkv programs would
        leave most SMs idle, and then enough splits for about two programs per SM, each split at least
        MIN_KEYS_PER_SPLIT keys long; or, with (WIDE_HEAD_)LONG_CONTEXT_KEYS_PER_SPLIT, into splits of about that
        many keys of max_seq_len."""
        if max_query_len != 1 or self.split_kv is False:
            return 1
        if self.forced_num_splits is not None:
            return max(1, self.forced_num_splits)
        work = num_reqs * num_kv_heads
        by_len = max_seq_len // self.MIN_KEYS_PER_SPLIT
        if self.split_kv is None and (work * 2 > self.num_sms or by_len < 2):
            long = self.by_width(head_dim, self.LONG_CONTEXT_KEYS_PER_SPLIT, self.WIDE_HEAD_LONG_CONTEXT_KEYS_PER_SPLIT)
            return min(_cdiv(max_seq_len, long), self.MAX_SPLITS) if long and max_seq_len >= 2 * long else 1
        splits = min(_cdiv(2 * self.num_sms, work), by_len, self.MAX_SPLITS)
        return max(splits, 2 if self.split_kv else 1)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_dim
        block_size = kv_cache.shape[2]
        kv_fp8 = kv_cache.element_size() == 1
        if kv_fp8 and (k_scale is None or v_scale is None):
            raise ValueError("an fp8 KV cache needs k_scale and v_scale")
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping, meta.num_actual_tokens, k_scale, v_scale)

        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        num_reqs = meta.seq_lens.shape[0]
        if num_tokens == 0 or num_reqs == 0:
            return out
        q = _last_dim_contiguous(q)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        g = num_heads // num_kv_heads
        head_dim_p = max(16, _next_pow2(head_dim))
        dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
        qk_scale = scale * _LOG2E
        block_tables = meta.block_tables
        common = {"HEAD_DIM": head_dim, "HEAD_DIM_P": head_dim_p, "BLOCK_SIZE": block_size, "DOT_PREC": dot_prec,
                  "KV_FP8": kv_fp8, "HAS_WINDOW": sliding_window is not None, "SOFT_CAP": logits_soft_cap is not None,
                  "HAS_SINKS": sinks is not None}
        # Unread when their switch is off; the cap in the kernels' log2 domain.
        window = sliding_window or 0
        soft_cap = (logits_soft_cap or 1.0) * _LOG2E
        scale_ptrs = (k_scale, v_scale) if kv_fp8 else (meta.seq_lens, meta.seq_lens)  # unread without fp8
        if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32):
            raise ValueError(f"sinks must be float32 [{num_heads}] (one logit per query head), got "
                             f"{sinks.dtype} {tuple(sinks.shape)}")
        sinks_ptr = sinks if sinks is not None else meta.seq_lens  # unread without sinks
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))

        args = (q, k_cache, v_cache, block_tables, meta.seq_lens, meta.query_start_loc, *scale_ptrs, sinks_ptr)
        strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides)
        num_splits = meta.num_kv_splits
        if num_splits is None or meta.max_query_len != 1:
            num_splits = self.choose_num_splits(num_reqs, num_kv_heads, meta.max_query_len, meta.max_seq_len,
                                                head_dim)
        if num_splits > 1:
            self._decode(out, args, strides, common, num_reqs, num_heads, g, num_splits, qk_scale, window, soft_cap,
                         meta.query_start_loc, sinks_ptr)
            return out

        # A long prefill step's decodes (one query token each) go to the decode kernel, whose splits spread a
        # long context over programs of few rows, not to a unified program of BLOCK_M rows that would hold one
        # token. Such steps are never captured in a CUDA graph, so the host's copies can be read.
        decode_seq_lens = self._mixed_step_decodes(meta, sliding_window)
        if decode_seq_lens:
            splits = self.choose_num_splits(len(decode_seq_lens), num_kv_heads, 1, max(decode_seq_lens), head_dim)
            self._decode(out, args, strides, common, num_reqs, num_heads, g, splits, qk_scale, window, soft_cap,
                         meta.query_start_loc, sinks_ptr)

        cfg = self.launch_config(meta.max_query_len, head_dim, q.element_size())
        block_m, tile_n, warps, stages = cfg
        block_m = max(block_m, _next_pow2(g))
        block_q = block_m // g
        num_tiles = num_tokens // block_q + num_reqs
        descs = self._tma_descriptors(k_cache, v_cache, meta.max_query_len, tile_n, q.dtype, head_dim_p)
        _unified_attention_kernel[(num_tiles * num_kv_heads,)](
            out, *args, num_reqs, qk_scale, window, soft_cap, *strides,
            NUM_KV_HEADS=num_kv_heads, NUM_Q_PER_KV=g, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
            SKIP_SINGLE_QUERIES=bool(decode_seq_lens), num_warps=warps, num_stages=stages, **common,
            k_desc=descs[0], v_desc=descs[1], KV_TMA=descs[0] is not None,
        )
        return out

    def _tma_descriptors(self, k_cache, v_cache, max_query_len, tile_n, dtype, head_dim_p):
        """TMA descriptors of the K and V caches seen as [blocks * block_size, kv heads * head_dim] rows, one
        [tile_n, head_dim] box a key step; (None, None) where the TMA path does not apply."""
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        if (not self.by_width(head_dim, self.TMA_KV, self.WIDE_HEAD_TMA_KV)
                or not self.long_prefill(max_query_len, dtype.itemsize) or k_cache.dtype != dtype
                or block_size % tile_n or head_dim != head_dim_p or not tma_supported(k_cache.device)):
            return None, None
        from triton.tools.tensor_descriptor import TensorDescriptor

        return tuple(TensorDescriptor.from_tensor(c.view(num_blocks * block_size, num_kv_heads * head_dim),
                                                  [tile_n, head_dim]) for c in (k_cache, v_cache))

    def _mixed_step_decodes(self, meta: AttentionMetadata, sliding_window: int | None) -> list[int]:
        """The context lengths of the one-token queries of a step with a query of at least
        LONG_PREFILL_MIN_QUERY tokens (empty for other steps, windowed layers, or with MIXED_STEP_DECODE_KERNEL
        off). In a windowed layer a decode's program walks no more keys than the chunk's: a second launch there has
        nothing to save."""
        if (not self.MIXED_STEP_DECODE_KERNEL or sliding_window is not None
                or meta.max_query_len < self.LONG_PREFILL_MIN_QUERY
                or meta.query_start_loc_cpu is None or meta.seq_lens_cpu is None):
            return []
        if "mixed_step_decodes" not in meta.backend_cache:  # once per step, not per layer
            qsl = meta.query_start_loc_cpu.tolist()
            seq_lens = meta.seq_lens_cpu.tolist()
            meta.backend_cache["mixed_step_decodes"] = [
                seq_lens[i] for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] == 1]
        return meta.backend_cache["mixed_step_decodes"]

    def _decode(self, out, args, strides, common, num_reqs, num_heads, g, num_splits, qk_scale, window, soft_cap,
                qsl, sinks_ptr):
        """The decode kernel (and with splits the combine kernel, which reads qsl and sinks_ptr) over the batch's
        one-token queries; args and strides: forward's, shared with the unified kernel."""
        head_dim, head_dim_p = common["HEAD_DIM"], common["HEAD_DIM_P"]
        block_m, tile_n, warps, stages = self.by_width(head_dim, self.SPLIT_CONFIG, self.WIDE_HEAD_SPLIT_CONFIG)
        block_m = max(block_m, _next_pow2(g))
        part_out = part_m = part_l = out  # unwritten with one split
        if num_splits > 1:
            part_out = torch.empty((num_reqs, num_heads, num_splits, head_dim_p), dtype=torch.float32,
                                   device=out.device)
            part_m = torch.empty((num_reqs, num_heads, num_splits), dtype=torch.float32, device=out.device)
            part_l = torch.empty_like(part_m)
        _decode_kernel[(num_reqs, num_heads // g, num_splits)](
            out, part_out, part_m, part_l, *args, qk_scale, window, soft_cap, *strides,
            NUM_HEADS=num_heads, NUM_Q_PER_KV=g, BLOCK_M=block_m, NUM_SPLITS=num_splits,
            TILE_N=tile_n, num_warps=warps, num_stages=stages, **common,
        )
        if num_splits > 1:
            _combine_splits_kernel[(num_reqs, num_heads)](
                out, part_out, part_m, part_l, qsl, sinks_ptr, strides[2], strides[3],
                NUM_HEADS=num_heads, NUM_SPLITS=num_splits, SPLITS_P=_next_pow2(num_splits),
                HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, HAS_SINKS=common["HAS_SINKS"], num_warps=4,
            )
