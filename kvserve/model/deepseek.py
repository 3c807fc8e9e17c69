"""DeepSeek-V3: multi-head latent attention (kvserve/ops/mla_attention.py) and a MoE block of grouped sigmoid
routing with an ungated shared expert (kvserve/model/moe.py), on the Llama decoder's layer order; the first
first_k_dense_replace layers keep a dense MLP.

MLA per layer: q = q_b_proj(norm(q_a_proj(x))) (or q_proj(x)), [q_nope, q_pe] per head; kv_a_proj_with_mqa(x)
gives the latent c (normed) and one rope key k_pe shared by all heads; only [c, k_pe] is cached; kv_b_proj
decompresses c into per-head k_nope and v. Rope turns q_pe and k_pe only, HF's interleaved pairs taken as
rotate-half halves (rope_interleave, as HF computes it). The softmax scale is (nope + rope) ** -0.5, times
YaRN's mscale(factor, mscale_all_dim) squared where the rope is YaRN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from kvserve.distributed.parallel_state import get_parallel_state
from kvserve.model.layers import ColumnParallelLinear, ReplicatedLinear, RMSNorm, RotaryEmbedding, RowParallelLinear
from kvserve.model.llama import MLP, _quant_method
from kvserve.model.llama_moe import MoeForCausalLM
from kvserve.model.model_config import ModelConfig
from kvserve.model.moe import SparseMoeBlock
from kvserve.ops.mla_attention import mla_attention

_LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm and kv_a_layernorm with the default eps, not rms_norm_eps


def mla_softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope_scaling or {}
    m_all = rope.get("mscale_all_dim")
    if rope.get("rope_type", rope.get("type")) == "yarn" and m_all and rope["factor"] > 1:
        mscale = 0.1 * m_all * math.log(rope["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... -> halves [x0, x2, ...], [x1, x3, ...]: rotate-half layout."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MlaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, quant_config=None, prefix: str = ""):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.nope, self.rope, self.v_dim, self.rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                                       cfg.kv_lora_rank)
        qk = self.nope + self.rope
        q = _quant_method
        if cfg.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(h, cfg.q_lora_rank, cfg.attention_bias,
                                             quant_method=q(quant_config, f"{prefix}.q_a_proj"))
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * qk,
                                                 quant_method=q(quant_config, f"{prefix}.q_b_proj"))
        else:
            self.q_proj = ColumnParallelLinear(h, heads * qk, quant_method=q(quant_config, f"{prefix}.q_proj"))
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.rank + self.rope, cfg.attention_bias,
                                                   quant_method=q(quant_config, f"{prefix}.kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + self.v_dim),
                                              quant_method=q(quant_config, f"{prefix}.kv_b_proj"))
        self.o_proj = RowParallelLinear(heads * self.v_dim, h, cfg.attention_bias,
                                        quant_method=q(quant_config, f"{prefix}.o_proj"))
        self.num_heads = heads // get_parallel_state().tp_size  # this rank's
        self.num_kv_heads = 1  # one latent entry per token (kvserve/ops/mla_attention.py)
        self.interleaved = cfg.rope_interleave
        self.scale = mla_softmax_scale(cfg)
        self.rotary = rotary

    def forward(self, positions, x, kv_cache, meta):
        t = x.shape[0]
        if hasattr(self, "q_b_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()[:, None]
        if self.interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        entries = torch.cat([latent, k_pe[:, 0]], dim=-1)
        out = mla_attention(q_nope, q_pe, entries, kv_cache, meta, self.rank, self.v_dim, self._decompress, self.scale)
        return self.o_proj(out.reshape(t, -1))

    def _decompress(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.kv_b_proj(latent).view(latent.shape[0], self.num_heads, self.nope + self.v_dim)
        return kv.split([self.nope, self.v_dim], dim=-1)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend, quant_config=None, prefix: str = "",
                 layer_idx: int = 0):
        super().__init__()
        self.self_attn = MlaAttention(cfg, rotary, quant_config, f"{prefix}.self_attn")
        if cfg.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(cfg, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = MLP(cfg, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV3ForCausalLM(MoeForCausalLM):
    # Only the MLPs' gate/up merge (the attention's projections stay separate).
    _MERGED = {".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}
    decoder_layer_cls = DeepseekDecoderLayer

    @staticmethod
    def _rotary(cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.qk_rope_head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        # HF names the (ungated) shared expert shared_experts; multi-token-prediction layers (model.layers.N
        # for N >= num_hidden_layers) belong to no stage and are skipped.
        return super().load_weights((name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor)
                                    for name, tensor in weights)
