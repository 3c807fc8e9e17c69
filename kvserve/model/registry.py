"""The one list of model architectures kvserve runs: HF architecture name -> model_type and model class.

Torch-free (class paths are strings, imported on demand), so config parsing, `kvserve plan` and error messages
read the same list the loader builds models from.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str  # HF config.json "architectures"[0]
    model_type: str  # HF config.json "model_type"
    model_class: str  # "module:ClassName" of our implementation


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama", "kvserve.model.llama:LlamaForCausalLM"),
        Architecture("MistralForCausalLM", "mistral", "kvserve.model.llama:MistralForCausalLM"),
        Architecture("Qwen2ForCausalLM", "qwen2", "kvserve.model.llama:Qwen2ForCausalLM"),
        Architecture("Qwen3ForCausalLM", "qwen3", "kvserve.model.llama:Qwen3ForCausalLM"),
        # Mixture of experts: the Llama decoder with a sparse MoE block as the MLP (kvserve/model/moe.py).
        Architecture("Qwen2MoeForCausalLM", "qwen2_moe", "kvserve.model.llama_moe:Qwen2MoeForCausalLM"),
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "kvserve.model.llama_moe:Qwen3MoeForCausalLM"),
        Architecture("MixtralForCausalLM", "mixtral", "kvserve.model.llama_moe:MixtralForCausalLM"),
        Architecture("GptOssForCausalLM", "gpt_oss", "kvserve.model.gpt_oss:GptOssForCausalLM"),
        # Multi-head latent attention (a compressed KV cache) with grouped sigmoid routing.
        Architecture("DeepseekV3ForCausalLM", "deepseek_v3", "kvserve.model.deepseek:DeepseekV3ForCausalLM"),
        Architecture("Gemma2ForCausalLM", "gemma2", "kvserve.model.gemma:Gemma2ForCausalLM"),
        Architecture("Gemma3ForCausalLM", "gemma3_text", "kvserve.model.gemma:Gemma3ForCausalLM"),
        Architecture("Phi3ForCausalLM", "phi3", "kvserve.model.phi3:Phi3ForCausalLM"),
        Architecture("GraniteForCausalLM", "granite", "kvserve.model.granite:GraniteForCausalLM"),
        Architecture("Olmo2ForCausalLM", "olmo2", "kvserve.model.olmo2:Olmo2ForCausalLM"),
        Architecture("CohereForCausalLM", "cohere", "kvserve.model.cohere:CohereForCausalLM"),
        Architecture("Cohere2ForCausalLM", "cohere2", "kvserve.model.cohere:Cohere2ForCausalLM"),
    )
}
# Architectures people ask for that are not built yet: what each one lacks, for the refusal.
MISSING: dict[str, str] = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2 needs its softmax group-limited routing, which kvserve does not "
                             "implement yet (DeepSeek-V3's latent attention and sigmoid routing run)",
}
_BY_MODEL_TYPE = {a.model_type: a.name for a in ARCHITECTURES.values()}


def architecture_of(hf_config: dict) -> str | None:
    """The architecture named by a config.json (its `architectures`, else its `model_type`), supported or not."""
    return (hf_config.get("architectures") or [None])[0] or _BY_MODEL_TYPE.get(hf_config.get("model_type", ""))


def supported_names() -> list[str]:
    return list(ARCHITECTURES)


def model_class(name: str) -> type:
    module, cls = ARCHITECTURES[name].model_class.split(":")
    return getattr(importlib.import_module(module), cls)
