"""A mixture-of-experts router's expert choice in one Triton launch.

Contract (the same as kvserve.model.moe.select_experts, which is its torch reference):
    logits [T, E] in any float dtype (one row per token, rows may be strided)
    kind "softmax_topk": probs = softmax(logits in fp32); (weights, ids) = the top_k probs, largest first;
        renormalize: weights / weights.sum()   (Qwen2/3-MoE, Mixtral)
    kind "topk_softmax": (values, ids) = the top_k logits; weights = softmax(values), rounded to the logits'
        dtype   (gpt-oss)
    returns weights float32 [T, top_k], ids int64 [T, top_k]; among equal scores the lower expert id is taken.

Why one kernel: torch takes five or six launches per layer for this (softmax, topk, sum, divide, casts), which
at batch 1 cost more GPU time than the layer's attention. Each program handles ROWS tokens with all E experts
in registers; top-k is k passes of (row max, lowest index at the max, mask it out): k is at most a few dozen.
"""

from __future__ import annotations

import torch

KINDS = ("softmax_topk", "topk_softmax")
_kernel = None


def _get_kernel():
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    # The token count changes with every step: not specialised on, so no recompiles mid-run.
    @triton.jit(do_not_specialize=["T"])
    def route(logits_ptr, weights_ptr, ids_ptr, T, E, stride_t, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_E: tl.constexpr, ROWS: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
              RENORMALIZE: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        e = tl.arange(0, BLOCK_E)
        valid = (rows[:, None] < T) & (e[None, :] < E)
        x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + e[None, :], mask=valid,
                    other=float("-inf")).to(tl.float32)
        if SOFTMAX_FIRST:
            row_max = tl.where(rows < T, tl.max(x, axis=1), 0.0)  # padding rows: no -inf - -inf
            shifted = tl.where(valid, x - row_max[:, None], float("-inf"))
            p = tl.exp(shifted)
            scores = p / tl.maximum(tl.sum(p, axis=1), 1e-30)[:, None]
        else:
            scores = x
        # Padding experts (and padding rows) never win: below every real score, probabilities or logits.
        scores = tl.where(valid, scores, float("-inf"))
        k = tl.arange(0, BLOCK_K)
        top_w = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
        top_i = tl.zeros([ROWS, BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(scores, axis=1)
            at_best = (scores == best[:, None]) & (e[None, :] < E)
            index = tl.min(tl.where(at_best, e[None, :], BLOCK_E), axis=1)
            top_w = tl.where(k[None, :] == j, best[:, None], top_w)
            top_i = tl.where(k[None, :] == j, index[:, None].to(tl.int64), top_i)
            scores = tl.where(e[None, :] == index[:, None], float("-inf"), scores)
        in_k = k[None, :] < TOP_K
        if SOFTMAX_FIRST:
            if RENORMALIZE:
                top_w = top_w / tl.maximum(tl.sum(tl.where(in_k, top_w, 0.0), axis=1), 1e-30)[:, None]
        else:  # softmax over the chosen logits; the first is the largest
            first = tl.max(tl.where(in_k, top_w, float("-inf")), axis=1)
            first = tl.where(rows < T, first, 0.0)  # padding rows hold -inf logits: no -inf - -inf
            p = tl.where(in_k, tl.exp(top_w - first[:, None]), 0.0)
            # In the logits' dtype, as the reference's softmax returns it (gpt-oss: HF's router does the same).
            top_w = (p / tl.maximum(tl.sum(p, axis=1), 1e-30)[:, None]).to(logits_ptr.dtype.element_ty).to(tl.float32)
        out = rows[:, None].to(tl.int64) * TOP_K + k[None, :]
        keep = (rows[:, None] < T) & in_k
        tl.store(weights_ptr + out, top_w, mask=keep)
        tl.store(ids_ptr + out, top_i, mask=keep)

    _kernel = route
    return _kernel


def select_experts_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                          kind: str = "softmax_topk") -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts (kvserve/model/moe.py) in one launch: (weights float32 [T, k], ids int64 [T, k])."""
    import triton

    if kind not in KINDS:
        raise ValueError(f"unknown router kind {kind!r}: one of {KINDS}")
    tokens, experts = router_logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k {top_k} must be between 1 and the number of experts ({experts})")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(experts)
    rows = max(1, min(16, 2048 // block_e))  # a fixed tile per expert count: one compile serves every step
    _get_kernel()[(triton.cdiv(tokens, rows),)](
        logits, weights, ids, tokens, experts, logits.stride(0), TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=block_e, ROWS=rows,
        SOFTMAX_FIRST=kind == "softmax_topk", RENORMALIZE=renormalize, num_warps=4)
    return weights, ids
