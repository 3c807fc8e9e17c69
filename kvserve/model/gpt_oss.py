"""gpt-oss: the Llama decoder with biased q/k/v/o projections, attention sinks, alternating windowed and full
layers (ModelConfig.layer_windows), YaRN rope, and a sparse MoE block in every layer (kvserve/model/moe.py:
a biased router whose top-k logits are softmaxed, biased experts with the clamped SwiGLU).

What differs here is the checkpoint: HF stores each layer's experts stacked and transposed
(`experts.gate_up_proj` [E, H, 2I] with gate and up features interleaved, `experts.down_proj` [E, I, H], and
biases [E, 2I] / [E, H]); the released checkpoints hold the two weights in MXFP4 instead (`_blocks` and
`_scales`, [E, out, in / 32, ...]: kvserve/model/quantization/mxfp4.py), kept packed where the experts' method
serves them so (FusedMoE.mxfp4_packed), else dequantized here at load. Either way each expert is split into our
layout (w13: gate rows, then up rows) one expert at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from kvserve.model.layers import as_tensor
from kvserve.model.llama_moe import MoeForCausalLM
from kvserve.model.moe import FusedMoE
from kvserve.ops.mxfp4 import GROUP, dequantize_mxfp4

_EXPERT_TENSOR = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def _expert(tensor, e: int) -> torch.Tensor:
    return as_tensor(tensor.narrow(0, e, 1))[0]


class GptOssForCausalLM(MoeForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        self._mxfp4_halves: dict[tuple[str, str], dict[str, object]] = {}  # (experts, proj) -> blocks / scales
        return super().load_weights(self._renamed(weights))

    def _renamed(self, weights: Iterable[tuple[str, object]]):
        for name, tensor in weights:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
        # Every tensor seen: an MXFP4 half still waiting names what is missing (before the generic checks).
        for (module, proj), halves in self._mxfp4_halves.items():
            have, lack = next(iter(halves)), ({"_blocks", "_scales"} - set(halves)).pop()
            raise ValueError(f"the checkpoint has model.{module}.{proj}{have} but no model.{module}.{proj}{lack}: "
                             f"an MXFP4 weight needs both; is the checkpoint complete?")

    def _load_one(self, params: dict, name: str, tensor) -> str:
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            return super()._load_one(params, name, tensor)
        module, proj, kind = match.groups()
        experts: FusedMoE = self.get_submodule(module)
        w13 = proj == "gate_up_proj"
        target = f"{module}.{'w13' if w13 else 'w2'}_{'bias' if kind == '_bias' else 'weight'}"
        if kind in ("_blocks", "_scales"):
            packed = getattr(experts, "mxfp4_packed", False)
            # Packed, the scales have a parameter of their own; dequantized, both halves make the weight.
            loads = f"{target}_scale" if packed and kind == "_scales" else target
            halves = self._mxfp4_halves.setdefault((module, proj), {})
            halves[kind] = tensor
            if len(halves) < 2:
                return loads  # loaded once its other half arrives
            del self._mxfp4_halves[(module, proj)]
            blocks, scales = halves["_blocks"], halves["_scales"]
            if packed:
                self._load_packed(experts, params, target, w13, blocks, scales)
                return loads

            def weight_of(e):  # MXFP4 is stored [out, in]: our orientation
                return dequantize_mxfp4(_expert(blocks, e), _expert(scales, e), torch.float32)
        elif kind is None:
            def weight_of(e):  # HF's float experts are [in, out]
                return _expert(tensor, e).t()
        else:
            weight_of = None
        param = params[target]
        for e in range(experts.num_experts):
            if not experts.is_local(e):
                continue  # expert parallelism: never read
            value = _expert(tensor, e) if weight_of is None else weight_of(e)
            if w13:  # gate and up features interleave: even rows gate, odd rows up
                experts.weight_loader(param, value[0::2], "gate", e)
                experts.weight_loader(param, value[1::2], "up", e)
            else:
                experts.weight_loader(param, value, "down", e)
            if weight_of is not None:
                experts.loaded_shards.update({(e, "gate"), (e, "up")} if w13 else {(e, "down")})
        return target

    @staticmethod
    def _load_packed(experts: FusedMoE, params: dict, target: str, w13: bool, blocks, scales) -> None:
        """MXFP4 experts as stored: each expert's bytes [out, in / 2] and scales [out, in / 32] (rows of gate and
        up interleaved, as for the float experts)."""
        for e in range(experts.num_experts):
            if not experts.is_local(e):
                continue
            expert_blocks = _expert(blocks, e)
            values = (expert_blocks.reshape(expert_blocks.shape[0], -1), 2, params[target]), \
                (_expert(scales, e), GROUP, params[target + "_scale"])
            for value, per_column, param in values:
                if w13:
                    experts.packed_weight_loader(param, value[0::2], "gate", e, per_column)
                    experts.packed_weight_loader(param, value[1::2], "up", e, per_column)
                else:
                    experts.packed_weight_loader(param, value, "down", e, per_column)
            experts.loaded_shards.update({(e, "gate"), (e, "up")} if w13 else {(e, "down")})
