"""The sparse mixture-of-experts block that replaces a decoder layer's MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss).

router (replicated) -> softmax over all experts -> top-k (renormalised where the model does it) -> routed
experts (kvserve/ops/fused_moe.py) [+ a shared expert behind a sigmoid gate] -> one all-reduce.
DeepSeek-V3 routes by grouped sigmoid scores (select_experts_grouped, its router and correction bias in fp32)
and adds an ungated shared expert. gpt-oss differs in three places: its router has a bias and takes the
top-k logits before a softmax over those k; its experts have biases; and their activation is its clamped SwiGLU (fused_moe.ExpertActivation).

Tensor parallelism as vLLM splits it: every rank holds every expert's slice of the intermediate features
(w13 rows, w2 columns), so each rank's output is a partial sum. With --enable-expert-parallel each rank holds
whole experts instead (vLLM's linear placement: consecutive experts, the first num_experts % tp ranks one
more) and contributes the pairs routed to them; the same all-reduce completes the sum either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import get_parallel_state, tensor_parallel_all_reduce
from kvserve.model.layers import ReplicatedLinear, as_tensor, copy_into, use_fused_kernels
from kvserve.model.model_config import ModelConfig
from kvserve.ops.fused_moe import SILU, ExpertActivation


# The router's softmax / top-k / renormalisation in one Triton launch where the fused kernels run.
FUSED_ROUTING = True


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, kind: str = "softmax_topk"):
    """(weights float32 [T, k], expert ids [T, k]): softmax in fp32, then top-k, as HF's routers compute them;
    kind "topk_softmax" (gpt-oss): the top-k logits, then a softmax over those k."""
    if FUSED_ROUTING and use_fused_kernels(router_logits):
        from kvserve.ops.moe_routing import select_experts_triton

        return select_experts_triton(router_logits, top_k, renormalize, kind)
    return select_experts_torch(router_logits, top_k, renormalize, kind)


def select_experts_torch(router_logits: torch.Tensor, top_k: int, renormalize: bool, kind: str = "softmax_topk"):
    """select_experts in torch ops (the CPU path and the fused kernel's reference)."""
    if kind == "topk_softmax":
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1).float(), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def select_experts_grouped(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                           topk_group: int, renormalize: bool, scaling: float):
    """DeepSeek-V3 (noaux_tc): sigmoid scores; experts chosen by score + correction bias within the topk_group
    groups (of n_group) whose two best biased scores sum highest; weights are the chosen experts' unbiased
    scores (renormalised where the model does it), times routed_scaling_factor. As HF computes it, in fp32."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    tokens, experts = choice.shape
    grouped = choice.view(tokens, n_group, experts // n_group)
    best_groups = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros(tokens, n_group, dtype=torch.bool, device=choice.device).scatter_(1, best_groups, True)
    choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(tokens, experts), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def expert_placement(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """(first expert, number of experts) on one expert-parallel rank."""
    base, extra = divmod(num_experts, ep_size)
    return ep_rank * base + min(ep_rank, extra), base + (1 if ep_rank < extra else 0)


class UnquantizedMoEMethod:
    """w13 [E_local, 2 * I_rank, H] (gate rows, then up rows), w2 [E_local, H, I_rank] in the serving dtype."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       params_dtype: torch.dtype) -> None:
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=params_dtype),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=params_dtype),
                                       requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def scales(self, layer: nn.Module):
        return None, None

    def quantizes_activations(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether the experts multiply x quantized to fp8 (W8A8) rather than in x's dtype."""
        return False

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor):
        w13_scale, w2_scale = self.scales(layer)
        extras = dict(w13_bias=layer.w13_bias, w2_bias=layer.w2_bias, activation=layer.activation,
                      quantize_activations=self.quantizes_activations(layer, x))
        if use_fused_kernels(x):
            from kvserve.ops.fused_moe import fused_moe_triton

            return fused_moe_triton(x, layer.w13_weight, layer.w2_weight, weights, local_ids, w13_scale, w2_scale,
                                    all_experts_local=layer.expert_map is None, **extras)
        from kvserve.ops.fused_moe import fused_moe_torch

        return fused_moe_torch(x, layer.w13_weight, layer.w2_weight, weights, local_ids, w13_scale, w2_scale,
                               **extras)


class FusedMoE(nn.Module):
    """This rank's routed experts, stacked; forward returns this rank's partial sum (not yet all-reduced)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, quant_method=None, prefix: str = "",
                 activation: ExpertActivation = SILU, has_bias: bool = False):
        """has_bias: each expert's projections have biases (gpt-oss), unquantized in the serving dtype."""
        super().__init__()
        ps = get_parallel_state()
        if ps.expert_parallel and ps.tp_size > 1:
            if num_experts < ps.tp_size:
                raise ValueError(f"--enable-expert-parallel: {num_experts} experts cannot be placed on "
                                 f"--tensor-parallel-size {ps.tp_size} ranks (every rank needs one); drop "
                                 f"--enable-expert-parallel to split each expert instead.")
            self.first_expert, self.num_local_experts = expert_placement(num_experts, ps.tp_size, ps.tp_rank)
            self.tp_size, self.tp_rank = 1, 0  # each local expert whole
            expert_map = torch.full((num_experts,), -1, dtype=torch.long)
            expert_map[self.first_expert:self.first_expert + self.num_local_experts] = torch.arange(
                self.num_local_experts)
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            if intermediate % ps.tp_size:
                raise ValueError(f"{prefix}: the experts' intermediate size {intermediate} is not divisible by "
                                 f"--tensor-parallel-size {ps.tp_size}; use a size that divides it, or "
                                 f"--enable-expert-parallel.")
            self.first_expert, self.num_local_experts = 0, num_experts
            self.tp_size, self.tp_rank = ps.tp_size, ps.tp_rank
            self.expert_map = None
        self.num_experts = num_experts
        self.intermediate = intermediate // self.tp_size  # per rank
        self.quant_method = quant_method or UnquantizedMoEMethod()
        self.quant_method.create_weights(self, self.num_local_experts, hidden, self.intermediate,
                                         torch.get_default_dtype())
        self.activation = activation
        self.w13_bias = self.w2_bias = None
        if has_bias:
            self.w13_bias = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.intermediate),
                                         requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(self.num_local_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local_ids = ids if self.expert_map is None else self.expert_map[ids]
        return self.quant_method.apply(self, x, weights, local_ids)

    def is_local(self, expert: int) -> bool:
        return 0 <= expert - self.first_expert < self.num_local_experts

    def weight_loader(self, param: nn.Parameter, loaded, shard: str, expert: int) -> bool:
        """One expert's gate_proj / up_proj / down_proj checkpoint tensor (shard "gate", "up" or "down"), or
        one of its biases (param w13_bias / w2_bias, same shard names); False when that expert lives on
        another rank."""
        local = expert - self.first_expert
        if not self.is_local(expert):
            return False
        size = self.intermediate
        if param is getattr(self, "w13_weight_scale", None) or param is getattr(self, "w2_weight_scale", None):
            self._load_scale(param, as_tensor(loaded).float(), shard, local, expert)
            return True
        if param is self.w2_bias:  # [H]: summed over the ranks' partial outputs, so added on one rank only
            copy_into(param.data[local], loaded if self.tp_rank == 0 else torch.zeros(loaded.shape),
                       f"expert {expert} down bias")
            return True
        if param is self.w13_bias:  # [I]: this rank's features of the gate or the up half
            target = param.data[local].narrow(0, 0 if shard == "gate" else size, size)
            copy_into(target, loaded.narrow(0, self.tp_rank * size, size), f"expert {expert} {shard} bias")
            return True
        if shard == "down":  # [H, I]: this rank's columns
            copy_into(param.data[local], loaded.narrow(1, self.tp_rank * size, size), f"expert {expert} {shard}")
        else:  # [I, H]: this rank's rows, into the gate or the up half
            target = param.data[local].narrow(0, 0 if shard == "gate" else size, size)
            copy_into(target, loaded.narrow(0, self.tp_rank * size, size), f"expert {expert} {shard}")
        return True

    def packed_weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str, expert: int,
                             inputs_per_column: int) -> bool:
        """One expert's projection (or its scales) in a packed format whose stored columns each hold
        `inputs_per_column` inputs (MXFP4: two a byte, its scales one a group): the rows are split as
        weight_loader splits them, the down projection's columns by this rank's share of the inputs."""
        local = expert - self.first_expert
        if not self.is_local(expert):
            return False
        size, what = self.intermediate, f"expert {expert} {shard}"
        if shard == "down":
            columns = size // inputs_per_column
            copy_into(param.data[local], loaded.narrow(1, self.tp_rank * columns, columns), what)
        else:
            target = param.data[local].narrow(0, 0 if shard == "gate" else size, size)
            copy_into(target, loaded.narrow(0, self.tp_rank * size, size), what)
        return True

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor, shard: str, local: int, expert: int) -> None:
        """An fp8 expert's weight_scale: one per tensor (spread over this rank's rows of it) or one per output
        channel ([N] or [N, 1]: this rank's rows). The down projection's rows (the hidden size) are not split."""
        what = f"expert {expert} {shard} weight_scale"
        rows = loaded.reshape(-1)
        if shard == "down":
            target = param.data[local]
        else:
            size = self.intermediate
            target = param.data[local].narrow(0, 0 if shard == "gate" else size, size)
            if rows.numel() > 1:
                if rows.numel() != size * self.tp_size:
                    raise ValueError(f"{what}: {rows.numel()} scales for {size * self.tp_size} rows; expected one per "
                                     f"tensor or one per output channel")
                rows = rows.narrow(0, self.tp_rank * size, size)
        if rows.numel() == 1:
            target.fill_(rows.item())
        else:
            copy_into(target, rows, what)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, quant_config=None, prefix: str = ""):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.router_kind = cfg.moe_router
        # The router stays unquantized (as in vLLM): its logits decide which experts run.
        if self.router_kind == "sigmoid_grouped":  # DeepSeek-V3: router and correction bias in fp32, as HF
            self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, params_dtype=torch.float32)
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32),
                                                             requires_grad=False)
            self.grouping = (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        else:
            self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, bias=cfg.moe_bias)
        method = quant_config.get_moe_method(f"{prefix}.experts") if quant_config is not None else None
        activation = ExpertActivation(cfg.moe_activation, cfg.swiglu_alpha, cfg.swiglu_limit)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, method,
                                f"{prefix}.experts", activation, has_bias=cfg.moe_bias)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            from kvserve.model.llama import MLP

            # Its down projection's partial sum joins the experts' before the block's one all-reduce.
            self.shared_expert = MLP(cfg, quant_config, f"{prefix}.shared_expert",
                                     intermediate_size=cfg.shared_expert_intermediate_size, reduce_results=False)
            if cfg.shared_expert_gated:
                self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1)
        self.tp_size = get_parallel_state().tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_kind == "sigmoid_grouped":
            weights, ids = select_experts_grouped(self.gate(x.float()), self.gate.e_score_correction_bias, self.top_k,
                                                  *self.grouping[:2], self.renormalize, self.grouping[2])
        else:
            weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize, self.router_kind)
        out = self.experts(x, weights, ids)
        if self.shared_expert_gate is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return tensor_parallel_all_reduce(out) if self.tp_size > 1 else out
