"""Mixture-of-experts models on the Llama decoder: Qwen2-MoE (qkv bias, a gated shared expert), Qwen3-MoE (q/k
norm, dense layers from decoder_sparse_step / mlp_only_layers) and Mixtral. The decoder layer picks the sparse
block (kvserve/model/moe.py) for the layers the config makes sparse; what differs here is the checkpoint names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.moe import FusedMoE

# HF's per-expert tensors (as save_pretrained writes them): layers.N.mlp.experts.E.{gate,up,down}_proj.weight
# and, in fp8 checkpoints, their .weight_scale and .input_scale.
_EXPERT_TENSOR = re.compile(
    r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale|input_scale)$")


class MoeForCausalLM(LlamaForCausalLM):
    def _load_one(self, params: dict, name: str, tensor) -> str:
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            return super()._load_one(params, name, tensor)
        module, expert, shard, kind = match.groups()
        target = f"{module}.{'w2_weight' if shard == 'down' else 'w13_weight'}"
        experts: FusedMoE = self.get_submodule(module)
        if kind != "weight":
            scale = f"{target}_scale"
            if scale not in params:
                raise ValueError(f"checkpoint tensor {name!r}: kvserve holds these experts unquantized; does the "
                                 f"checkpoint's quantization_config say they are fp8?")
            if kind == "weight_scale":  # input_scale: activations are quantized per token (Fp8CheckpointMoEMethod)
                experts.weight_loader(params[scale], tensor, shard, int(expert))
            return scale
        if experts.weight_loader(params[target], tensor, shard, int(expert)):
            experts.loaded_shards.add((int(expert), shard))
        return target

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.loaded_shards = set()
        loaded = super().load_weights(weights)
        # The stacked parameters count as loaded with their first expert: check that every expert arrived.
        for name, module in self.named_modules():
            if isinstance(module, FusedMoE):
                local = range(module.first_expert, module.first_expert + module.num_local_experts)
                missing = [(e, s) for e in local for s in ("gate", "up", "down") if (e, s) not in module.loaded_shards]
                if missing:
                    raise ValueError(f"checkpoint lacks {len(missing)} expert tensors of {name}, e.g. "
                                     f"experts.{missing[0][0]}.{missing[0][1]}_proj.weight")
        return loaded


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass


class MixtralForCausalLM(MoeForCausalLM):
    # Mixtral's checkpoints name the block block_sparse_moe and the experts' projections w1 (gate), w3 (up), w2 (down).
    _RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        return super().load_weights((self._hf_name(name), tensor) for name, tensor in weights)

    def _hf_name(self, name: str) -> str:
        for old, new in self._RENAMES:
            name = name.replace(old, new)
        return name
