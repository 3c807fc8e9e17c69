"""The EAGLE-3 draft head, in the format of the public checkpoints (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).

An EAGLE-3 head is one Llama decoder layer that predicts the target's next token from two inputs per
position: the embedding of the token at that position, and a hidden state. For the first draft, that hidden
state is `fc` applied to three of the target's residual-stream states concatenated (the inputs of target
layers 2, L // 2 and L - 3 unless the head's config names others in `eagle_aux_hidden_state_layer_ids`);
for each further draft it is the head's own pre-norm output at the previous position, so drafts chain.

Checkpoint layout: `fc.weight` [H, 3 * H_target]; `midlayer.*` a Llama layer whose q/k/v projections read
2H features (cat(input_layernorm(embedding), hidden_norm(hidden))), plus `midlayer.hidden_norm`; `norm`;
`lm_head.weight` [draft_vocab, H] over a reduced vocabulary; `d2t` [draft_vocab] int64 with
target id = draft id + d2t[draft id]; `t2d` (target -> in draft vocabulary, unused here). The token
embedding is usually absent: the head then shares the target's. The layer has its own one-layer KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.model.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    as_tensor,
)
from kvserve.model.llama import MLP, Attention, LlamaForCausalLM
from kvserve.model.model_config import ModelConfig
from kvserve.ops.attention_backend import AttentionBackend
from kvserve.ops.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's decoder-layer shapes (num_hidden_layers is 1)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose input residual stream feeds `fc`
    norm_before_residual: bool

    @classmethod
    def from_hf_dict(cls, cfg: dict, target: ModelConfig) -> "Eagle3Config":
        arch = (cfg.get("architectures") or [""])[0]
        if "eagle3" not in arch.lower() and "draft_vocab_size" not in cfg:
            raise ValueError(f"not an EAGLE-3 head: config.json has architecture {arch!r} and no draft_vocab_size")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE-3 heads with {cfg['num_hidden_layers']} layers are not supported (only one)")
        if cfg.get("vocab_size", target.vocab_size) != target.vocab_size:
            raise ValueError(f"the EAGLE-3 head's vocabulary ({cfg['vocab_size']}) is not the target's "
                             f"({target.vocab_size}): it was trained for another model")
        eagle = cfg.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise ValueError("EAGLE-3 heads without auxiliary hidden states (use_aux_hidden_state: false) "
                             "are not supported")
        num_layers = target.num_hidden_layers
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        ids = tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)
        if len(ids) != 3 or len(set(ids)) != 3 or not all(1 <= i < num_layers for i in ids):
            raise ValueError(f"EAGLE-3 auxiliary layers {ids} must be three target layers in 1..{num_layers - 1}, "
                             f"all different (the head config's eagle_aux_hidden_state_layer_ids)")
        layer_cfg = ModelConfig.from_hf_dict({**cfg, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
        return cls(layer=layer_cfg, draft_vocab_size=cfg.get("draft_vocab_size") or target.vocab_size,
                   target_hidden_size=cfg.get("target_hidden_size") or target.hidden_size,
                   aux_layer_ids=ids, norm_before_residual=bool(cfg.get("norm_before_residual", False)))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        lc = cfg.layer
        self.norm_before_residual = cfg.norm_before_residual
        self.self_attn = Attention(lc, rotary, backend)
        # q/k/v read the embedding and the hidden state side by side: 2H input features.
        self.self_attn.qkv_proj = QKVParallelLinear(2 * lc.hidden_size, lc.head_dim, lc.num_attention_heads,
                                                    lc.num_key_value_heads, lc.attention_bias)
        self.mlp = MLP(lc)
        self.input_layernorm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)

    def forward(self, positions, embeds, hidden, kv_cache, meta):
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        out = self.self_attn(positions, torch.cat([embeds, hidden], dim=-1), kv_cache, meta)
        out, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(out), residual


class Eagle3Head(nn.Module):
    _MERGED = LlamaForCausalLM._MERGED

    def __init__(self, cfg: Eagle3Config, backend: AttentionBackend, max_positions: int):
        super().__init__()
        lc = cfg.layer
        self.config = cfg
        self.rotary = RotaryEmbedding(lc.head_dim, max_positions, lc.rope_theta, lc.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(lc.vocab_size, lc.hidden_size)
        self.fc = ReplicatedLinear(3 * cfg.target_hidden_size, lc.hidden_size)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, self.rotary, backend)])
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, lc.hidden_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    def share_embedding(self, target_embedding: VocabParallelEmbedding) -> None:
        """Heads saved without a token embedding use the target's (one tensor, not a copy)."""
        self.embed_tokens = target_embedding

    def combine(self, aux_hidden: list[torch.Tensor]) -> torch.Tensor:
        """The target's three residual-stream states [T, H_target] each -> the head's input state [T, H]."""
        return self.fc(torch.cat(aux_hidden, dim=-1))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (normed states for the LM head, pre-norm states: the next draft position's `hidden`)."""
        out, residual = self.layers[0](positions, self.embed_tokens(input_ids), hidden, kv_cache, meta)
        return self.norm(out, residual)

    def compute_draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[T, draft_vocab] logits over the head's reduced vocabulary."""
        return self.lm_head.compute_logits(normed)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_probs(self, draft_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The draft distribution over the target's vocabulary (0 outside the reduced one)."""
        probs = draft_logits.float().softmax(-1)
        ids = self.to_target_ids(torch.arange(probs.shape[-1], device=probs.device))
        return probs.new_zeros(probs.shape[0], vocab_size).index_copy_(1, ids, probs)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Checkpoint names (midlayer.*, fc, norm, lm_head, d2t, t2d, optional embed_tokens) -> ours."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "t2d" or "rotary_emb.inv_freq" in name:
                continue
            if name == "d2t":
                self.d2t.copy_(as_tensor(tensor).to(torch.int64))
                loaded.add(name)
                continue
            name = name.replace("midlayer.", "layers.0.")
            shard = None
            for hf_part, (our_part, shard_id) in self._MERGED.items():
                if hf_part in name:
                    name, shard = name.replace(hf_part, our_part), shard_id
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"EAGLE-3 checkpoint tensor {name!r} has no matching parameter")
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            loader = getattr(param, "weight_loader", None) or owner.weight_loader
            with torch.no_grad():
                loader(param, tensor, shard)
            loaded.add(name)
        return loaded
