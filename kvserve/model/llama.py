"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) over a paged KV cache.

Inputs are one flat batch: all scheduled tokens of all requests concatenated, [T]. Attention reads
and writes the cache through the backend, using the step's AttentionMetadata passed down explicitly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import get_parallel_state
from kvserve.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    use_fused_kernels,
)
from kvserve.model.model_config import ModelConfig
from kvserve.ops.attention_backend import AttentionBackend
from kvserve.ops.attention_metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias)
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size)
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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.intermediate = self.gate_up_proj.output_partition_sizes[0]  # this rank's share
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if use_fused_kernels(gate_up):
            from kvserve.ops.fused_kernels import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.self_attn = Attention(cfg, rotary, backend)
        self.mlp = MLP(cfg)
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

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 layer_range: tuple[int, int] | None = None):
        """layer_range: the decoder layers this pipeline stage runs (default: all)."""
        super().__init__()
        self.config = cfg
        ps = get_parallel_state()
        self.is_first_stage, self.is_last_stage = ps.is_first_stage, ps.is_last_stage
        self.start_layer, self.end_layer = layer_range or (0, cfg.num_hidden_layers)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.is_first_stage else None
        # Layers of other stages are empty placeholders, so parameter names stay the checkpoint's.
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, rotary, backend) if self.start_layer <= i < self.end_layer else nn.Module()
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = self.lm_head = None
        if self.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
                self.lm_head.weight = self.embed_tokens.weight  # tied: one tensor
            else:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        # Shared by all layers; registered once here so .to(device) moves it once.
        self.rotary = rotary

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[self.start_layer].self_attn.num_kv_heads

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Returns the final hidden states on the last stage, (hidden, residual) for the next stage on the others."""
        if self.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        for layer, kv_cache in zip(self.layers[self.start_layer:self.end_layer], kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if not self.is_last_stage:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def _on_this_rank(self, name: str) -> bool:
        """Whether a checkpoint tensor (our name) belongs to this pipeline stage."""
        if name.startswith("layers."):
            return self.start_layer <= int(name.split(".", 2)[1]) < self.end_layer
        if name.startswith("embed_tokens."):
            return self.embed_tokens is not None
        return self.is_last_stage  # norm, lm_head

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Load HF-named tensors (or lazy slices, read only for this rank's part); returns the names of our
        parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            targets = [name]
            if name == "embed_tokens.weight" and self.config.tie_word_embeddings and self.is_last_stage \
                    and self.lm_head.weight is not getattr(self.embed_tokens, "weight", None):
                targets = ["lm_head.weight"] + ([name] if self.embed_tokens is not None else [])
            elif not self._on_this_rank(name):
                continue
            for target in targets:
                loaded.add(self._load_one(params, target, tensor))
        return loaded

    def _load_one(self, params: dict, name: str, tensor) -> str:
        shard = None
        for hf_part, (our_part, shard_id) in self._MERGED.items():
            if hf_part in name:
                name, shard = name.replace(hf_part, our_part), shard_id
                break
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
        owner = self.get_submodule(name.rsplit(".", 1)[0])
        loader = getattr(param, "weight_loader", None) or owner.weight_loader
        with torch.no_grad():
            loader(param, tensor, shard)
        return name


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
