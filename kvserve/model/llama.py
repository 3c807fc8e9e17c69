"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) over a paged KV cache.

Inputs are one flat batch: all scheduled tokens of all requests concatenated, [T]. Attention reads
and writes the cache through the backend, using the step's AttentionMetadata passed down explicitly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.layers import (
    MergedColumnLinear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    ColumnParallelLinear,
    VocabEmbedding,
    use_fused_kernels,
)
from kvserve.model.model_config import ModelConfig
from kvserve.ops.attention_backend import AttentionBackend
from kvserve.ops.attention_metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, quant_config=None,
                 prefix: str = ""):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, cfg.attention_bias,
                                  quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.backend = backend

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, quant_config=None, prefix: str = ""):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = MergedColumnLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                               quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if use_fused_kernels(gate_up):
            from kvserve.ops.fused_kernels import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, quant_config=None,
                 prefix: str = ""):
        super().__init__()
        self.self_attn = Attention(cfg, rotary, backend, quant_config, f"{prefix}.self_attn")
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


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (our parameter, shard id) for projections we merge into one GEMM.
    _MERGED = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, quant_config=None):
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, rotary, backend, quant_config, f"layers.{i}") for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size)
        # Shared by all layers; registered once here so .to(device) moves it once.
        self.rotary = rotary

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata):
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of our parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            shard = None
            for hf_part, (our_part, shard_id) in self._MERGED.items():
                if hf_part in name:
                    name, shard = name.replace(hf_part, our_part), shard_id
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            with torch.no_grad():
                owner.weight_loader(param, tensor, shard)
            loaded.add(name)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
