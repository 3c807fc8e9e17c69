"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences.

Both: (1 + weight) RMSNorm in fp32, a norm after attention and around the MLP (pre and post feed-forward),
the embedding scaled by sqrt(hidden) in the activation dtype, a GeLU-tanh gate, softmax scale
query_pre_attn_scalar ** -0.5, and interleaved windowed / full layers (ModelConfig.layer_windows).
Gemma 2 soft-caps attention scores and final logits; Gemma 3 instead has q/k norms and its own rope base
for the windowed layers. The per-layer attention options live in llama.Attention, read from the config.
"""

from __future__ import annotations

import torch

from kvserve.model.layers import GemmaRMSNorm
from kvserve.model.llama import Attention, DecoderLayer, LlamaForCausalLM


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg, rotary, backend, quant_config=None, prefix: str = "", layer_idx: int = 0):
        super().__init__(cfg, rotary, backend, quant_config, prefix, layer_idx)
        self.self_attn = Attention(cfg, rotary, backend, quant_config, f"{prefix}.self_attn", layer_idx,
                                   norm_cls=GemmaRMSNorm)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        # Set by the model for consecutive layers of one stage (link_next): this layer's output norm, the
        # residual add and the next layer's input norm then run as one kernel here.
        self.next_input_norm: GemmaRMSNorm | None = None

    def link_next(self, following: "GemmaDecoderLayer") -> None:
        # A plain attribute, not a submodule: the norm's weight belongs to the following layer.
        object.__setattr__(self, "next_input_norm", following.input_layernorm)
        following.input_is_normed = True

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """Returns (sublayer output, residual): the caller adds them (the next layer's input norm, or the
        final norm), as in Llama; here each sublayer's output is normed before it is added. A linked layer
        returns (the next layer's normed input, residual) instead, and the next one takes it as it is."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        elif not self.input_is_normed:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm.then_add_norm(
            self.pre_feedforward_layernorm, self.self_attn(positions, hidden, kv_cache, meta), residual)
        if self.next_input_norm is not None:
            return self.post_feedforward_layernorm.then_add_norm(self.next_input_norm, self.mlp(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        local = self.layers[self.start_layer:self.end_layer]
        for layer, following in zip(local, local[1:]):
            layer.link_next(following)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # HF rounds sqrt(hidden) to the activation dtype before the product.
        return hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    pass
