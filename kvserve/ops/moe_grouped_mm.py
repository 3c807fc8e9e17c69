"""Routed experts through torch's grouped GEMM: the contract of kvserve.ops.fused_moe.fused_moe_triton, with the
two expert GEMMs done by torch._grouped_mm (bf16 / fp16 / fp32 experts) or torch._scaled_grouped_mm (fp8 experts
on the W8A8 path), which run CUTLASS grouped GEMMs on Hopper GPUs.

How: the (token, k) pairs are sorted by expert into one contiguous run each (the library takes each run's end
offset, so there is no padding to a row tile); x's rows are gathered in that order (quantized per token first
for W8A8, each row keeping its token's scale); gate_up, the activation (quantized per pair row for W8A8) and the
down projection run in sorted order; each pair's row goes back to its (token, k) place, is scaled by its routing
weight, and a token's k rows are summed in fp32. W8A8 here is the row-wise recipe of the Triton path: e4m3 x
e4m3 with a float32 scale per activation row and per weight output channel. fp8 weight-only (W8A16) has no
grouped GEMM in torch and is not offered (`serves` says False).

Pairs routed to other ranks (expert parallelism: id -1) sort after every local run, past the last offset: the
library leaves their rows unwritten and the sum gives them weight 0. No host syncs: every size follows from the
token count, so a step can be captured in a CUDA graph.

Which steps take this path is decided in one place, `serves`: steps of at least MIN_TOKENS tokens (None: none)
on a device and dtype the library supports (a Hopper or newer GPU; bf16 experts, or fp8 ones on W8A8).
"""

from __future__ import annotations

import torch

from kvserve.ops.fused_moe import SILU, ExpertActivation

# Steps of at least this many tokens use the library's grouped GEMM; None: never (the Triton path serves all).
MIN_TOKENS: int | None = None


def serves(tokens: int, x: torch.Tensor, weights_fp8: bool, quantize_activations: bool) -> bool:
    """Whether a step of `tokens` tokens goes through fused_moe_grouped_mm."""
    if MIN_TOKENS is None or tokens < MIN_TOKENS or not x.is_cuda:
        return False
    if weights_fp8 and not quantize_activations:
        return False  # no W8A16 grouped GEMM in torch
    if not weights_fp8 and x.dtype != torch.bfloat16:
        return False  # the CUDA grouped GEMM is bf16 only
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def _grouped(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, a_scale, w_scale, out_dtype) -> torch.Tensor:
    """a [rows, K] (sorted by expert) @ w[e]^T for each expert's run; w [E, N, K]; offs [E] int32 run ends."""
    if a_scale is None:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    return torch._scaled_grouped_mm(a, w.transpose(1, 2), a_scale.reshape(-1), w_scale, offs=offs,
                                    out_dtype=out_dtype)


def fused_moe_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         local_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                         w2_scale: torch.Tensor | None = None, all_experts_local: bool = True,
                         w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                         activation: ExpertActivation = SILU, quantize_activations: bool = False) -> torch.Tensor:
    """Same contract as fused_moe_torch / fused_moe_triton (all_experts_local is implied by the ids)."""
    if w13_scale is not None and not quantize_activations:
        raise ValueError("fp8 experts take the grouped GEMM only on the W8A8 path (quantize_activations)")
    tokens, top_k = local_ids.shape
    num_experts = w2.shape[0]
    flat = local_ids.reshape(-1)
    bucket = torch.where(flat < 0, num_experts, flat)  # bucket E: another rank's, after every local run
    order = torch.argsort(bucket, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_experts], 0, dtype=torch.int32)
    rows = order // top_k
    sorted_expert = bucket[order].clamp(max=num_experts - 1)  # the biases' rows (elsewhere: never read back)

    if quantize_activations:
        from kvserve.ops import fp8_quant

        q, q_scale = fp8_quant.quantize_per_token(x)  # once per token; its k pairs share the row and scale
        a, a_scale = q[rows], q_scale[rows]
    else:
        a, a_scale = x[rows], None
    gate_up = _grouped(a, w13, offs, a_scale, w13_scale, x.dtype)
    if w13_bias is not None:
        gate_up = gate_up + w13_bias[sorted_expert]
    hidden, hidden_scale = _activate(gate_up, activation, quantize_activations)
    down = _grouped(hidden, w2, offs, hidden_scale, w2_scale, x.dtype)
    if w2_bias is not None:
        down = down + w2_bias[sorted_expert]
    in_place = torch.empty_like(down)
    in_place[order] = down  # each pair's row back at its (token, k) place
    in_place = torch.where((flat >= 0)[:, None], in_place.float(), 0.0)  # unwritten rows may hold NaN bits
    return (in_place * topk_weights.reshape(-1, 1).float()).view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def _activate(gate_up: torch.Tensor, activation: ExpertActivation, quantize: bool):
    """(hidden, its per-row float32 scales or None). The fused Triton kernels on a GPU, torch ops elsewhere."""
    if gate_up.is_cuda and activation.kind == "silu":
        from kvserve.ops.fused_kernels import silu_and_mul, silu_and_mul_fp8

        if quantize:
            hidden, scale, _ = silu_and_mul_fp8(gate_up)
            return hidden, scale
        return silu_and_mul(gate_up), None
    hidden = activation(gate_up).contiguous()
    if not quantize:
        return hidden, None
    from kvserve.ops import fp8_quant

    return fp8_quant.quantize_per_token(hidden)
