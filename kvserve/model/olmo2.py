"""OLMo 2 (Olmo2ForCausalLM): Llama with the norms moved. No norm before attention or the MLP; each
sublayer's output is normed (post_attention_layernorm, post_feedforward_layernorm) before it joins the
residual; q and k are RMS-normed over the whole projection (all heads together), before rotary."""

from __future__ import annotations

from kvserve.model.layers import ProjectionRMSNorm
from kvserve.model.llama import DecoderLayer, LlamaForCausalLM


class Olmo2DecoderLayer(DecoderLayer):
    def __init__(self, cfg, rotary, backend, quant_config=None, prefix: str = "", layer_idx: int = 0):
        super().__init__(cfg, rotary, backend, quant_config, prefix, layer_idx)
        attn = self.self_attn
        qkv = attn.qkv_proj
        kv_shard = qkv.tp_rank // qkv.num_kv_head_replicas
        attn.q_norm = ProjectionRMSNorm(attn.q_size, qkv.tp_rank, cfg.rms_norm_eps)
        attn.k_norm = ProjectionRMSNorm(attn.kv_size, kv_shard, cfg.rms_norm_eps)
        attn.norm_whole_projection = True
        del self.input_layernorm
        self.post_feedforward_layernorm = type(self.post_attention_layernorm)(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is not None:
            hidden = hidden + residual
        residual = hidden
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden = residual + hidden
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Olmo2DecoderLayer
