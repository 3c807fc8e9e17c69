"""Phi-3 / Phi-4 (Phi3ForCausalLM): the Llama decoder; its checkpoints store q/k/v as one `qkv_proj` and
gate/up as one `gate_up_proj`. They are cut into their parts here, so tensor parallelism shards each part
as for Llama. Partial rotary (Phi-4-mini) and the window (Phi-3-mini) come from the config."""

from __future__ import annotations

import torch

from kvserve.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def _load_one(self, params: dict, name: str, tensor) -> str:
        cfg = self.config
        if ".qkv_proj." in name:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            parts = [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]
        elif ".gate_up_proj." in name:
            parts = [(0, 0, cfg.intermediate_size), (1, cfg.intermediate_size, cfg.intermediate_size)]
        else:
            return super()._load_one(params, name, tensor)
        if tensor.shape[0] != sum(size for _, _, size in parts):
            raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} is not the fused "
                             f"projection this config describes")
        param = params[name]
        owner = self.get_submodule(name.rsplit(".", 1)[0])
        loader = getattr(param, "weight_loader", None) or owner.weight_loader
        with torch.no_grad():
            for shard, start, size in parts:
                loader(param, tensor.narrow(0, start, size), shard)
        return name
