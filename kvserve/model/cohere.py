"""Cohere Command-R (CohereForCausalLM) and Command R7B / A (Cohere2ForCausalLM): the Llama decoder with

- a parallel block: one LayerNorm (mean-centred, weight only, fp32) feeds attention and the MLP, and both
  join the residual: out = (residual + attention) + mlp;
- rotary on interleaved pairs (2i, 2i + 1) instead of halves: the q and k projection rows (and the q/k
  norm weights) are permuted at load, evens first, so the rotate-half rotary turns the same pairs (q . k
  is unchanged by one permutation of both);
- optional q/k LayerNorm per head, each head with its own weight (use_qk_norm);
- logits scaled by logit_scale (LlamaForCausalLM.compute_logits).
Cohere 2 interleaves windowed layers (with rotary) and full layers without any position encoding.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.layers import as_tensor, copy_into
from kvserve.model.llama import DecoderLayer, LlamaForCausalLM


class CohereLayerNorm(nn.Module):
    """LayerNorm without bias over the last dim (of a head, with a weight per head: shape (heads, dim)),
    in fp32, weight applied before rounding. With `residual`: (norm(x + residual), x + residual)."""

    def __init__(self, shape: int | tuple[int, int], eps: float, first_row: int = 0):
        super().__init__()
        self.eps = eps
        self.first_row = first_row  # per head: this rank's first head in the checkpoint's weight
        self.weight = nn.Parameter(torch.ones(shape), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, consumer=None):
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        var = (xf - mean).pow(2).mean(-1, keepdim=True)
        out = (self.weight.float() * ((xf - mean) * torch.rsqrt(var + self.eps))).to(x.dtype)
        return out if residual is None else (out, residual)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 2:  # this rank's heads
            loaded = as_tensor(loaded).narrow(0, self.first_row, param.shape[0])
        copy_into(param.data, loaded, "weight")


class NoRotary(nn.Module):
    """Cohere 2's full-attention layers: no position encoding at all."""

    def forward(self, positions, q, k):
        return q, k


class CohereDecoderLayer(DecoderLayer):
    def __init__(self, cfg, rotary, backend, quant_config=None, prefix: str = "", layer_idx: int = 0):
        super().__init__(cfg, rotary, backend, quant_config, prefix, layer_idx)
        if cfg.attention_bias:
            raise ValueError("Cohere with attention_bias (a bias on o_proj too) is not supported")
        del self.post_attention_layernorm
        self.input_layernorm = CohereLayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        attn = self.self_attn
        if cfg.qk_norm:
            qkv = attn.qkv_proj
            kv_rank = qkv.tp_rank // qkv.num_kv_head_replicas
            attn.q_norm = CohereLayerNorm((attn.num_heads, attn.head_dim), cfg.rms_norm_eps,
                                          qkv.tp_rank * attn.num_heads)
            attn.k_norm = CohereLayerNorm((attn.num_kv_heads, attn.head_dim), cfg.rms_norm_eps,
                                          kv_rank * attn.num_kv_heads)
        if cfg.rope_windowed_layers_only and attn.sliding_window is None:
            attn.rotary = NoRotary()

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """Returns (mlp output, residual + attention output): the caller's add then gives HF's
        (residual + attention) + mlp, rounding for rounding."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        attention = self.self_attn(positions, hidden, kv_cache, meta)
        return self.mlp(hidden), residual + attention


# Checkpoint tensors whose rows (q, k projections) or last dim (q/k norms) are per head in the
# interleaved rotary layout.
_ROTARY_ROWS = (".self_attn.q_proj.", ".self_attn.k_proj.")
_ROTARY_NORMS = (".self_attn.q_norm.weight", ".self_attn.k_norm.weight")


def halves_from_interleaved(name: str, tensor, head_dim: int):
    """The tensor with each head's dims reordered evens first, then odds, where the name needs it."""
    if not (any(part in name for part in _ROTARY_ROWS) or name.endswith(_ROTARY_NORMS)):
        return tensor
    t = as_tensor(tensor)
    perm = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    if name.endswith(_ROTARY_NORMS):  # (heads, head_dim)
        return t[:, perm]
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise ValueError(f"{name}: a packed (int4) q/k projection cannot be reordered for Cohere's rotary")
    if name.endswith(".weight") or name.endswith(".bias"):
        rows = t.shape[0]
        return t.reshape(rows // head_dim, head_dim, *t.shape[1:])[:, perm].reshape(t.shape)
    return t  # a per-tensor scale


class CohereForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = CohereDecoderLayer
    norm_cls = CohereLayerNorm

    def load_weights(self, weights):
        head_dim = self.config.head_dim
        return super().load_weights((name, halves_from_interleaved(name, tensor, head_dim)) for name, tensor in weights)


class Cohere2ForCausalLM(CohereForCausalLM):
    pass
