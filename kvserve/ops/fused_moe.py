"""Routed experts of a MoE layer: out[t] = sum_k w[t, k] * down_e(act(gate_e(x[t]), up_e(x[t]))), e = ids[t, k].

`act` is an ExpertActivation: silu(gate) * up (every family but gpt-oss), or gpt-oss's clamped SwiGLU. gpt-oss's
experts also have biases (w13_bias [E, 2 * I], w2_bias [E, H]), added to each projection's output before the
activation and before the routing weight.

Two implementations of the same function:
* `fused_moe_torch`: the reference (CPU and tests), one pair of GEMMs per expert that has tokens, summed in
  the order HF transformers' eager experts sum them.
* `fused_moe_triton`: grouped GEMMs in Triton. The (token, k) pairs are sorted by expert and each expert's run
  is padded to the GEMM's BLOCK_M (kvserve/ops/moe_align.py), so every block of rows belongs to one expert
  (small steps skip the sort: one block per pair); one kernel computes gate_up for every pair, one
  SiLU-and-mul, one kernel the down projection (scaled by the routing weight), then the k partial rows of a
  token are summed. Every launch size depends only on the token count, never on the routing, so the whole
  layer can be captured in a CUDA graph.

Expert weights are stacked: w13 [E, 2 * I, H] (gate rows, then up rows), w2 [E, H, I]. FP8 experts hold e4m3
weights with per-output-channel float32 scales (w13_scale [E, 2 * I], w2_scale [E, H]), multiplied one of two ways
(the caller picks by token count: kvserve/model/quantization/fp8_moe.py's FP8_MOE_PATHS):
* weight-only (W8A16): the kernel converts each e4m3 weight tile to the activation dtype and multiplies in it;
  the per-channel scale is applied to the fp32 accumulator after the K loop.
* W8A8 (`quantize_activations`): each GEMM's A operand is quantized per row to e4m3 with a dynamic scale
  (max |row| / 448: kvserve/ops/fp8_e4m3.py, in Triton fp8_quant.py): x once per token for gate_up (a token's
  K pairs share its row and its scale), the activated pairs per pair row for the down projection (in the
  SiLU-and-mul kernel itself, silu_and_mul_fp8; after gpt-oss's activation, a separate pass). tl.dot multiplies
  e4m3 by e4m3 on the FP8 tensor cores into fp32, scaled after the K loop by a_scale[row] * w_scale[column].
  Twice the bf16 MMA rate, one more launch (x's quantization) than weight-only, and the activations' rounding
  to 3 mantissa bits.
MXFP4 experts (gpt-oss's checkpoints; uint8 weights, kvserve/ops/mxfp4.py) stay packed: w13 [E, 2 * I, H / 2] and
w2 [E, H, I / 2] bytes of two E2M1 values, with uint8 E8M0 scales [E, N, K / 32] in place of w13_scale / w2_scale.
The kernel decodes each weight tile (bit operations, then the group's power of two) to the activation dtype,
exactly, and multiplies in it; the sums are those of the dequantized weights. Weight-only: x is not quantized.
The reference dequantizes the weights (and, for W8A8, quantizes and dequantizes the activations the same way,
multiplying in fp32).
Experts not on this rank (expert parallelism) have id -1 in `local_ids` and contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.ops.mxfp4 import GROUP as MXFP4_GROUP
from kvserve.ops.mxfp4 import dequantize_mxfp4, is_mxfp4


@dataclass(frozen=True)
class ExpertActivation:
    """"silu": silu(gate) * up. "swiglu_oai" (gpt-oss): gate clamped above at `limit`, up to [-limit, limit],
    then gate * sigmoid(alpha * gate) * (up + 1), as HF's GptOssExperts computes it."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[P, 2 * I] (gate columns, then up columns) -> [P, I]."""
        inter = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = ExpertActivation()


def _dequantized(w: torch.Tensor, scale: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w[e]
    if is_mxfp4(w):
        return dequantize_mxfp4(w[e], scale[e], dtype)
    return (w[e].float() * scale[e][:, None]).to(dtype)


def _fp8_rows(t: torch.Tensor) -> torch.Tensor:
    """t quantized per row to e4m3 as the W8A8 kernels quantize it, dequantized to fp32."""
    from kvserve.ops.fp8_e4m3 import quantize_per_token

    q, scale = quantize_per_token(t)
    return q.float() * scale


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    local_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None, w13_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None, activation: ExpertActivation = SILU,
                    quantize_activations: bool = False) -> torch.Tensor:
    """x [T, H]; topk_weights [T, K] (float32); local_ids [T, K] (this rank's expert index, -1: elsewhere).
    quantize_activations (fp8 experts): the W8A8 math, each GEMM's input quantized per row (x per token, the
    activated pairs per pair), both operands dequantized and multiplied in fp32; rounded to x's dtype where the
    Triton path stores (gate_up, and each pair's weighted output row), its K rows summed in fp32."""
    _check_formats(w13, w13_scale, w2_scale, quantize_activations)
    dot_dtype = torch.float32 if quantize_activations else x.dtype
    a = _fp8_rows(x) if quantize_activations else x  # once per token: a token's K pairs share its row
    out = torch.zeros(x.shape, dtype=torch.float32 if quantize_activations else x.dtype, device=x.device)
    for e in torch.unique(local_ids).tolist():
        if e < 0:
            continue
        token, slot = torch.where(local_ids == e)
        gate_up = F.linear(a[token], _dequantized(w13, w13_scale, e, dot_dtype)).to(x.dtype)
        if w13_bias is not None:  # added after the product, as HF adds it (not fused into the GEMM)
            gate_up = gate_up + w13_bias[e]
        hidden = activation(gate_up)
        if quantize_activations:
            hidden = _fp8_rows(hidden)  # per pair row
        y = F.linear(hidden, _dequantized(w2, w2_scale, e, dot_dtype))
        if w2_bias is not None:
            y = y + w2_bias[e]
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(x.dtype).to(out.dtype))
    return out.to(x.dtype)


def _check_formats(w13, w13_scale, w2_scale, quantize_activations: bool) -> None:
    if quantize_activations and (w13_scale is None or w2_scale is None or is_mxfp4(w13)):
        raise ValueError("quantize_activations needs fp8 experts (e4m3 weights, w13_scale and w2_scale)")
    if is_mxfp4(w13) and (w13_scale is None or w2_scale is None):
        raise ValueError("MXFP4 experts (uint8 weights) need their E8M0 scales as w13_scale and w2_scale")


# Steps of up to this many (token, k) pairs may skip the sort: each pair is its own block (PER_PAIR).
PER_PAIR_MAX_PAIRS = 64


def _tiles(per_pair, block_m, block_n, block_k, group_m, warps, stages, swap_ab=False, fast_accum=False,
           **down) -> dict:
    """down: the down projection's own BLOCK_N / BLOCK_K / GROUP_M / num_warps / num_stages / SWAP_AB /
    FAST_ACCUM where they differ (its K is the expert width, gate_up's the hidden size); both GEMMs share the
    row layout."""
    return dict(PER_PAIR=per_pair, SWAP_AB=swap_ab, FAST_ACCUM=fast_accum, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_K=block_k, GROUP_M=group_m, num_warps=warps, num_stages=stages, DOWN=down)


def _gemm_config(pairs: int, num_experts: int, top_k: int = 1, fp8: bool = False) -> dict:
    """Tile sizes by rows per expert, measured on the H200 (benchmarks/sweep_moe_tiles.py; BENCHMARKS.md):
    small (decode) steps take short row blocks, so padding costs little; fp8 (W8A8) tiles are deeper in K.
    PER_PAIR: one program per (pair, block of N) reads its pair's expert straight from the routing ids, with no
    sort and no launch for it. A weight tile that two pairs share is read once per pair (from L2 when both
    programs run at once, which the launch order arranges), so it serves only steps whose pairs rarely share
    an expert: a token's own k pairs never do, and at most half as many pairs as experts seldom."""
    if pairs <= min(PER_PAIR_MAX_PAIRS, max(top_k, num_experts // 2)):
        return _tiles(True, 16, 32, 128, 1, 2, 5)
    if pairs <= num_experts * 4:
        return _tiles(False, 16, 64, 256, 1, 4, 3) if fp8 else _tiles(False, 16, 64, 128, 1, 4, 3)
    if pairs <= num_experts * 32:
        return _tiles(False, 32, 64, 128, 4, 4, 4) if fp8 else _tiles(False, 32, 128, 128, 4, 4, 3)
    if fp8:
        return _tiles(False, 64, 128, 128, 8, 8, 4)
    if pairs <= num_experts * 256:
        return _tiles(False, 64, 128, 64, 8, 4, 3)
    return _tiles(False, 128, 256, 64, 8, 8, 3)


def _down_config(cfg: dict) -> dict:
    return {**{k: v for k, v in cfg.items() if k != "DOWN"}, **cfg.get("DOWN", {})}


_kernel = None


def _get_kernel():
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_pairs", "capacity"])
    def moe_grouped_gemm(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, weights_ptr, sorted_pairs_ptr,
                         block_expert_ptr, num_rows_ptr, N, K, num_pairs, capacity,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         stride_se, stride_sn, stride_sk, stride_bias_e,
                         A_ROWS_PER_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
                         HAS_A_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PER_PAIR: tl.constexpr,
                         SWAP_AB: tl.constexpr, FAST_ACCUM: tl.constexpr, B_MXFP4: tl.constexpr,
                         MX_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """C[pair, :] = (A[row of pair] @ B[expert]^T (* a_scale[row] * scale) (+ bias[expert])) (* routing
        weight), one block of sorted pairs (one expert) by one block of N per program. A_ROWS_PER_PAIR: K pairs
        share a token's row of x (the gate_up GEMM), or each pair has its own row (the down GEMM reads the
        activated pairs). HAS_A_SCALE (W8A8): A is e4m3 with one float32 scale per row.
        PER_PAIR: no sorted layout; program (block of N, pair) computes that one pair's row (row 0 of its
        BLOCK_M), its expert read from block_expert_ptr, which then holds the routing ids, one per pair.
        SWAP_AB: the same product computed transposed (the same sums; the tile layout differs); 16-bit A only.
        FAST_ACCUM: the K loop accumulates inside the dot (tl.dot's acc). The same sums for 16/32-bit operands
        (Triton makes `acc += dot` into that anyway); for e4m3 x e4m3 on sm_90 it lets the FP8 tensor cores
        accumulate the whole K in their reduced-precision accumulator (torch._scaled_mm's use_fast_accum),
        where `acc += dot` adds each BLOCK_K's product into fp32.
        B_MXFP4: B is MXFP4 bytes [E, N, K / 2] (stride_bk steps one byte: two inputs) and b_scale_ptr its E8M0
        scales [E, N, K / MX_GROUP] (stride_sk), decoded per tile into A's dtype; HAS_SCALE is then False."""
        pid = tl.program_id(0)
        if PER_PAIR:
            # The pairs of one block of N run side by side: pairs that share an expert share its tile in L2.
            pid_n = pid // num_pairs
            pair_id = pid % num_pairs
            expert = tl.load(block_expert_ptr + pair_id).to(tl.int64)
            if expert < 0:  # routed to another rank
                return
            offs_row = tl.arange(0, BLOCK_M)
            pair = tl.zeros([BLOCK_M], dtype=tl.int64) + pair_id
            pair_mask = offs_row == 0
        else:
            num_pid_m = tl.cdiv(capacity, BLOCK_M)
            num_pid_n = tl.cdiv(N, BLOCK_N)
            # Grouped ordering: GROUP_M row blocks share each B tile while it is in L2.
            group = GROUP_M * num_pid_n
            first_m = (pid // group) * GROUP_M
            group_m = min(num_pid_m - first_m, GROUP_M)
            pid_m = first_m + ((pid % group) % group_m)
            pid_n = (pid % group) // group_m
            if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
                return
            expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
            pair_mask = pair < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_row = pair // A_ROWS_PER_PAIR
        if SWAP_AB:
            # C^T = B A^T: the weight tile is the MMA's tall side (Hopper's warpgroup MMA wants 64+ rows
            # there), the few rows of pairs its narrow side.
            a_ptrs = a_ptr + a_row[None, :] * stride_am + offs_k[:, None] * stride_ak
            b_ptrs = b_ptr + expert * stride_be + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=pair_mask[None, :] & (offs_k[:, None] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
                if FAST_ACCUM:
                    acc_t = tl.dot(b.to(a.dtype), a, acc_t)
                else:
                    acc_t += tl.dot(b.to(a.dtype), a)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            acc = tl.trans(acc_t)
        else:
            a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
            b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
            if B_MXFP4:  # [BLOCK_N, BLOCK_K / 2] bytes, and the scale of each input's group
                offs_kb = tl.arange(0, BLOCK_K // 2)
                b_ptrs = b_ptr + expert * stride_be + offs_n[:, None] * stride_bn + offs_kb[None, :] * stride_bk
                s_ptrs = (b_scale_ptr + expert * stride_se + offs_n[:, None] * stride_sn
                          + (offs_k // MX_GROUP)[None, :] * stride_sk)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=pair_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
                if B_MXFP4:
                    packed = tl.load(b_ptrs, mask=n_mask[:, None] & (offs_kb[None, :] < k_left // 2), other=0)
                    packed = packed.to(tl.int32)
                    # Input 2j is byte j's low nibble, 2j + 1 its high one. E2M1 magnitude m = 2e + f as an fp32:
                    # e = 0 is 0 or 0.5 (exponent field 126, no mantissa), else 2^(e-1) * (1 + f/2).
                    nib = tl.interleave(packed & 15, packed >> 4)
                    mag = nib & 7
                    exp = mag >> 1
                    bits = ((exp + 126) << 23) | tl.where(exp > 0, (mag & 1) << 22, 0)
                    w = tl.where(mag == 0, 0, bits).to(tl.float32, bitcast=True)
                    w = tl.where(nib >= 8, -w, w)
                    # The group's E8M0 scale 2^(s - 127) is the fp32 with exponent field s (s = 0 reads as 0).
                    scale = tl.load(s_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < k_left), other=127)
                    w *= (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
                    b = tl.trans(w.to(a.dtype))  # exact: at most 2 significant bits times a power of two
                    s_ptrs += (BLOCK_K // MX_GROUP) * stride_sk
                else:
                    b = tl.load(b_ptrs, mask=n_mask[None, :] & (offs_k[:, None] < k_left), other=0.0)
                # e4m3 A (W8A8): e4m3 x e4m3 on the FP8 tensor cores; else the weight in A's dtype. fp32 sums.
                if FAST_ACCUM:
                    acc = tl.dot(a, b.to(a.dtype), acc)
                else:
                    acc += tl.dot(a, b.to(a.dtype))
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += (BLOCK_K // 2 if B_MXFP4 else BLOCK_K) * stride_bk
        if HAS_A_SCALE:
            acc *= tl.load(a_scale_ptr + a_row, mask=pair_mask, other=0.0)[:, None]
        if HAS_SCALE:
            acc *= tl.load(b_scale_ptr + expert * stride_se + offs_n * stride_sn, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if MUL_WEIGHT:
            acc *= tl.load(weights_ptr + pair, mask=pair_mask, other=0.0)[:, None]
        c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])

    _kernel = moe_grouped_gemm
    return _kernel


def _grouped_gemm(a, b, b_scale, bias, c, weights, sorted_pairs, block_expert, num_rows, a_rows_per_pair, cfg,
                  a_scale=None):
    """a_scale: float32 [rows of a, 1] when a holds e4m3 rows (W8A8). With cfg["PER_PAIR"], block_expert is
    the routing ids ([pairs], -1: another rank's) and sorted_pairs / num_rows are not read."""
    import triton

    num_pairs = c.shape[0]
    mxfp4 = is_mxfp4(b)
    n, k = b.shape[1], b.shape[2] * (2 if mxfp4 else 1)
    capacity = sorted_pairs.numel()
    cfg = {k: v for k, v in cfg.items() if k != "DOWN"}
    if mxfp4 and (cfg["SWAP_AB"] or cfg["BLOCK_K"] % MXFP4_GROUP or a_scale is not None):
        raise ValueError(f"MXFP4 experts take 16/32-bit activations and tiles with SWAP_AB=False and BLOCK_K a "
                         f"multiple of {MXFP4_GROUP}, not {cfg}")
    if cfg["SWAP_AB"] and a.element_size() == 1:
        # Compiled for sm_90 (Triton 3.6), e4m3 x e4m3 with the rows of pairs as the MMA's narrow side gave wrong
        # sums on the H200 (BENCHMARKS.md, 2026-12-03): the transposed product serves 16-bit operands only.
        raise ValueError("SWAP_AB tiles take 16-bit operands only: W8A8 (e4m3 activations) needs SWAP_AB=False")
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    blocks_m = num_pairs if cfg["PER_PAIR"] else triton.cdiv(capacity, block_m)
    grid = (blocks_m * triton.cdiv(n, block_n),)
    scale = b_scale if b_scale is not None else b  # unused without HAS_SCALE
    if bias is not None:
        assert bias.stride(-1) == 1
    if a_scale is not None:
        assert a_scale.is_contiguous() and a_scale.numel() == a.shape[0]
    _get_kernel()[grid](
        a, b, c, a_scale if a_scale is not None else c, scale, bias if bias is not None else c,
        weights if weights is not None else c, sorted_pairs,
        block_expert, num_rows, n, k, num_pairs, capacity,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        scale.stride(0) if b_scale is not None else 0, scale.stride(1) if b_scale is not None else 0,
        scale.stride(2) if mxfp4 else 0, bias.stride(0) if bias is not None else 0,
        A_ROWS_PER_PAIR=a_rows_per_pair, MUL_WEIGHT=weights is not None, HAS_SCALE=b_scale is not None and not mxfp4,
        HAS_A_SCALE=a_scale is not None, HAS_BIAS=bias is not None, B_MXFP4=mxfp4, MX_GROUP=MXFP4_GROUP, **cfg,
    )


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     local_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None, all_experts_local: bool = True,
                     w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                     activation: ExpertActivation = SILU, quantize_activations: bool = False) -> torch.Tensor:
    """Same contract as fused_moe_torch. all_experts_local=False (expert parallelism): pairs routed elsewhere
    leave their rows zero. quantize_activations: the W8A8 path (fp8 experts). Steps that
    kvserve/ops/moe_grouped_mm.py serves go to torch's grouped GEMM instead."""
    _check_formats(w13, w13_scale, w2_scale, quantize_activations)
    from kvserve.ops import moe_grouped_mm

    if not is_mxfp4(w13) and moe_grouped_mm.serves(local_ids.shape[0], x, w13_scale is not None,
                                                    quantize_activations):
        return moe_grouped_mm.fused_moe_grouped_mm(x, w13, w2, topk_weights, local_ids, w13_scale, w2_scale,
                                                   all_experts_local, w13_bias, w2_bias, activation,
                                                   quantize_activations)
    from kvserve.ops import fp8_quant
    from kvserve.ops.fused_kernels import silu_and_mul, silu_and_mul_fp8
    from kvserve.ops.moe_align import align_block_size_triton
    from kvserve.ops.moe_sum import sum_pairs

    tokens, top_k = local_ids.shape
    num_experts, inter = w2.shape[0], w2.shape[-1] * (2 if is_mxfp4(w2) else 1)
    pairs = tokens * top_k
    cfg = _gemm_config(pairs, num_experts, top_k, fp8=quantize_activations)
    if cfg["PER_PAIR"]:
        ids = local_ids.reshape(-1)
        sorted_pairs, block_expert, num_rows = ids, ids, ids  # the kernel reads the ids alone
    else:
        sorted_pairs, block_expert, num_rows = align_block_size_triton(local_ids, num_experts, cfg["BLOCK_M"])
    # Rows of pairs routed to other ranks are never written: zeros, so the sum below reads nothing stale.
    alloc = torch.empty if all_experts_local else torch.zeros
    gate_up = alloc(pairs, 2 * inter, dtype=x.dtype, device=x.device)
    # W8A8: x quantized once per token (its K pairs read the same e4m3 row and scale).
    a, a_scale = fp8_quant.quantize_per_token(x) if quantize_activations else (x, None)
    _grouped_gemm(a, w13, w13_scale, w13_bias, gate_up, None, sorted_pairs, block_expert, num_rows, top_k, cfg,
                  a_scale)
    hidden_scale = None
    if activation.kind == "silu" and quantize_activations:
        hidden, hidden_scale, _ = silu_and_mul_fp8(gate_up)  # per pair row, in the same pass
    elif activation.kind == "silu":
        hidden = silu_and_mul(gate_up)
    else:  # gpt-oss's clamped SwiGLU: elementwise torch ops between the two GEMMs (no fused kernel for it yet)
        hidden = activation(gate_up).contiguous()
        if quantize_activations:
            hidden, hidden_scale = fp8_quant.quantize_per_token(hidden)
    down = alloc(pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(hidden, w2, w2_scale, w2_bias, down, weights, sorted_pairs, block_expert, num_rows, 1,
                  _down_config(cfg), hidden_scale)
    return sum_pairs(down, top_k)
