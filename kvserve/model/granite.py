"""Granite (GraniteForCausalLM): Llama with four multipliers. The embedding is scaled by
embedding_multiplier, each sublayer's output by residual_multiplier before it joins the residual, the
softmax scale is attention_multiplier (llama.Attention reads it) and logits are divided by logits_scaling
(LlamaForCausalLM.compute_logits)."""

from __future__ import annotations

import torch

from kvserve.model.llama import DecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, cfg, rotary, backend, quant_config=None, prefix: str = "", layer_idx: int = 0):
        super().__init__(cfg, rotary, backend, quant_config, prefix, layer_idx)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GraniteDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.config.embedding_multiplier
