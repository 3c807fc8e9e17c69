"""Read GGUF checkpoints as an HF-style config dict and float32 weights under HF names.

Supports the llama.cpp architectures "llama" (also used for Mistral and SmolLM GGUFs, and for Mixtral with
expert_count set), "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmo2", "gemma2", "gemma3", "phi3", "granite",
"command-r", "cohere2", "gpt-oss" and "deepseek2" (DeepSeek-V3). Family settings that llama.cpp keeps outside
the HF config's shape (Gemma's (1 + w) norm weights, Phi-3's LongRoPE factor tensors, Granite's multipliers,
gpt-oss's split experts, DeepSeek's split kv_b) are turned back into HF's. A MoE layer's stacked expert tensors
(ffn_*_exps, [E, out, in]) are yielded per expert under HF's names; the MoE block is named `mlp` (as in Qwen's
checkpoints; kvserve's Mixtral reads both). Weights are dequantised with gguf-py exactly as transformers does,
so for the architectures transformers reads the tensors are bit-identical to
``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Union

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

GGUFSource = Union[str, os.PathLike, GGUFReader]
_MISSING = object()


@dataclass(frozen=True)
class _ArchSpec:
    hf_class: str
    model_type: str
    # llama.cpp's converter interleaves Q/K rows for llama-family rope; we must undo it.
    permute_qk: bool
    # Layer tensors named otherwise than in the llama layout (_LAYER_TENSORS), GGUF name -> HF module.
    layer_tensors: tuple[tuple[str, str], ...] = ()
    # The HF config fields only this family has, from its GGUF metadata (see _family_config below).
    family_config: Callable[["_Metadata", dict], dict] | None = None
    # llama.cpp's Gemma converter stores every RMSNorm weight as 1 + w (its graph multiplies by the weight).
    norm_weights_plus_one: bool = False
    # rope.dimension_count is the rotary part of the head (Phi-4-mini, Command R7B), not head_dim.
    partial_rotary: bool = False
    # gpt-oss: HF stacks each layer's experts as one gate_up_proj [E, H, 2I] (gate and up features
    # interleaved) and down_proj [E, I, H]; llama.cpp's converter splits and transposes them.
    hf_stacked_experts: bool = False


_GEMMA_TENSORS = (("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
                  ("post_ffw_norm", "post_feedforward_layernorm"))
# llama.cpp's graphs scale Gemma's queries by 1/sqrt(hidden / heads) for the 27B models (known by their
# layer count) and by 1/sqrt(head_dim) otherwise; GGUF has no query_pre_attn_scalar key.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's windowed-layer patterns where the file does not carry one: every n-th layer is full.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "gpt-oss": 2}


@dataclass(frozen=True)
class _Metadata:
    """One file's metadata under one architecture's keys, and its small config-carrying tensors."""
    reader: GGUFReader
    arch: str

    def get(self, key: str, default: Any = _MISSING) -> Any:
        return _metadata(self.reader, f"{self.arch}.{key}", default)

    def tensor(self, name: str) -> np.ndarray | None:
        found = next((t for t in self.reader.tensors if t.name == name), None)
        return None if found is None else _dequantize_tensor(found)


def _layer_types(meta: _Metadata, n_layers: int) -> list[str]:
    pattern = meta.get("attention.sliding_window_pattern", _SWA_PATTERN[meta.arch])
    if isinstance(pattern, list):  # one flag per layer: true = windowed
        if len(pattern) != n_layers:
            raise ValueError(f"{_file_name(meta.reader)}: {meta.arch}.attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {n_layers} layers")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n_layers)]


def _gemma_config(meta: _Metadata, config: dict) -> dict:
    heads, n_layers = config["num_attention_heads"], config["num_hidden_layers"]
    scale = meta.get("attention.scale", None)
    if scale is not None:
        scalar = float(scale) ** -2
    elif n_layers == _GEMMA_27B_LAYERS[meta.arch]:
        scalar = config["hidden_size"] // heads
    else:
        scalar = config["head_dim"]
    fields = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
              "final_logit_softcapping": meta.get("final_logit_softcapping", None)}
    window = meta.get("attention.sliding_window", None)
    if window:
        fields.update(sliding_window=int(window), layer_types=_layer_types(meta, n_layers))
    if meta.arch == "gemma2":
        fields["attn_logit_softcapping"] = meta.get("attn_logit_softcapping", None)
    else:
        full = {"rope_type": "default", "rope_theta": config["rope_theta"]}
        kind = meta.get("rope.scaling.type", "none")
        if kind == "linear":
            full.update(rope_type="linear", factor=float(meta.get("rope.scaling.factor")))
        elif kind != "none":
            raise ValueError(f"{_file_name(meta.reader)}: {meta.arch}.rope.scaling.type {kind!r} is not "
                             f"Gemma 3's (linear or none)")
        local = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0))}
        fields["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return fields


def _phi3_config(meta: _Metadata, config: dict) -> dict:
    fields = {}
    window = meta.get("attention.sliding_window", 0)
    fields["sliding_window"] = int(window) if window else None
    original = meta.get("rope.scaling.original_context_length", None)
    if original is not None:
        fields["original_max_position_embeddings"] = int(original)
    long, short = meta.tensor("rope_factors_long.weight"), meta.tensor("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise ValueError(f"{_file_name(meta.reader)}: LongRoPE needs both rope_factors_long.weight and "
                         f"rope_factors_short.weight; the file has only one")
    if long is not None:
        if original is None:
            raise ValueError(f"{_file_name(meta.reader)}: LongRoPE factors without "
                             f"{meta.arch}.rope.scaling.original_context_length")
        fields["rope_parameters"] = {**config["rope_parameters"], "rope_type": "longrope",
                                     "long_factor": long.tolist(), "short_factor": short.tolist()}
    return fields


def _granite_config(meta: _Metadata, config: dict) -> dict:
    keys = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
            "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}
    return {hf: float(v) for hf, key in keys.items() if (v := meta.get(key, None)) is not None}


def _cohere_config(meta: _Metadata, config: dict) -> dict:
    fields = {"logit_scale": float(meta.get("logit_scale", 1.0)), "layer_norm_eps": config.pop("rms_norm_eps"),
              "use_qk_norm": config["use_qk_norm"]}
    if meta.arch == "cohere2":
        window = meta.get("attention.sliding_window", None)
        if window:
            fields.update(sliding_window=int(window), layer_types=_layer_types(meta, config["num_hidden_layers"]))
    return fields


def _gpt_oss_config(meta: _Metadata, config: dict) -> dict:
    fields = {"swiglu_limit": _uniform(meta, "swiglu_clamp_exp", 7.0)}  # llama.cpp's gpt-oss graph: 7
    window = meta.get("attention.sliding_window", None)
    if window:
        fields.update(sliding_window=int(window), layer_types=_layer_types(meta, config["num_hidden_layers"]))
    kind = meta.get("rope.scaling.type", "none")
    if kind == "yarn":
        # gpt-oss's own config turns YaRN's truncation off; the GGUF does not record it.
        fields["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": config["rope_theta"], "factor": float(meta.get("rope.scaling.factor")),
            "original_max_position_embeddings": int(meta.get("rope.scaling.original_context_length")),
            "beta_fast": float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    elif kind != "none":
        raise ValueError(f"{_file_name(meta.reader)}: {meta.arch}.rope.scaling.type {kind!r} is not gpt-oss's "
                         f"(yarn or none)")
    return fields


def _deepseek_config(meta: _Metadata, config: dict) -> dict:
    gating = int(meta.get("expert_gating_func", 2))
    if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise ValueError(f"{_file_name(meta.reader)}: {meta.arch}.expert_gating_func {gating} (softmax) is "
                         f"DeepSeek-V2's routing, which kvserve does not implement; DeepSeek-V3's sigmoid (2) runs")
    rope_dim = int(meta.get("rope.dimension_count"))
    # Newer converters record the MLA head sizes in *_mla and the absorbed cache's in key/value_length.
    key_length = int(meta.get("attention.key_length_mla", None) or meta.get("attention.key_length"))
    value_length = int(meta.get("attention.value_length_mla", None) or meta.get("attention.value_length"))
    heads = config["num_attention_heads"]
    fields = {
        "kv_lora_rank": int(meta.get("attention.kv_lora_rank")),
        "q_lora_rank": meta.get("attention.q_lora_rank", None),
        "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": key_length - rope_dim, "v_head_dim": value_length,
        "head_dim": rope_dim, "num_key_value_heads": heads,  # MLA: every head reads the shared latent
        "n_routed_experts": int(meta.get("expert_count")), "num_experts_per_tok": int(meta.get("expert_used_count")),
        "moe_intermediate_size": int(meta.get("expert_feed_forward_length")),
        "n_shared_experts": int(meta.get("expert_shared_count", 0)),
        "routed_scaling_factor": float(meta.get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", False)),
        "n_group": int(meta.get("expert_group_count", 1)), "topk_group": int(meta.get("expert_group_used_count", 1)),
        "first_k_dense_replace": int(meta.get("leading_dense_block_count", 0)),
    }
    if fields["q_lora_rank"] is not None:
        fields["q_lora_rank"] = int(fields["q_lora_rank"])
    kind = meta.get("rope.scaling.type", "none")
    if kind == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim and cancels YaRN's cos/sin factor, which HF does where
        # mscale == mscale_all_dim (as in DeepSeek-V3's config).
        # (The file holds the product in float32: round off what that adds.)
        mscale = round(float(meta.get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
        fields["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": config["rope_theta"], "factor": float(meta.get("rope.scaling.factor")),
            "original_max_position_embeddings": int(meta.get("rope.scaling.original_context_length")),
            "beta_fast": float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale, "mscale_all_dim": mscale}
    elif kind != "none":
        raise ValueError(f"{_file_name(meta.reader)}: {meta.arch}.rope.scaling.type {kind!r} is not DeepSeek-V3's "
                         f"(yarn or none)")
    return fields


def _uniform(meta: _Metadata, key: str, default: float) -> float:
    """A per-layer metadata array that kvserve holds as one number: refused unless every layer agrees."""
    value = meta.get(key, None)
    if value is None:
        return default
    values = set(value) if isinstance(value, list) else {value}
    if len(values) != 1:
        raise ValueError(f"{_file_name(meta.reader)}: {meta.arch}.{key} differs between layers ({sorted(values)}); "
                         f"kvserve supports one value for every layer")
    return float(values.pop())


_ARCHS = {
    "llama": _ArchSpec("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": _ArchSpec("Qwen2ForCausalLM", "qwen2", permute_qk=False),
    "qwen3": _ArchSpec("Qwen3ForCausalLM", "qwen3", permute_qk=False),
    "qwen2moe": _ArchSpec("Qwen2MoeForCausalLM", "qwen2_moe", permute_qk=False),
    "qwen3moe": _ArchSpec("Qwen3MoeForCausalLM", "qwen3_moe", permute_qk=False),
    # OLMo 2: no pre-norms; each sublayer's output is normed (llama.cpp's post_attention_norm, post_ffw_norm).
    "olmo2": _ArchSpec("Olmo2ForCausalLM", "olmo2", permute_qk=False,
                       layer_tensors=(("post_attention_norm", "post_attention_layernorm"),
                                      ("post_ffw_norm", "post_feedforward_layernorm"))),
    "gemma2": _ArchSpec("Gemma2ForCausalLM", "gemma2", permute_qk=False, layer_tensors=_GEMMA_TENSORS,
                        family_config=_gemma_config, norm_weights_plus_one=True),
    "gemma3": _ArchSpec("Gemma3ForCausalLM", "gemma3_text", permute_qk=False, layer_tensors=_GEMMA_TENSORS,
                        family_config=_gemma_config, norm_weights_plus_one=True),
    # Phi-3 keeps HF's fused projections: attn_qkv is qkv_proj, ffn_up is gate_up_proj (gate rows first).
    "phi3": _ArchSpec("Phi3ForCausalLM", "phi3", permute_qk=False, family_config=_phi3_config, partial_rotary=True,
                      layer_tensors=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj"))),
    # Granite is converted as llama (q/k rows permuted), plus its four multipliers.
    "granite": _ArchSpec("GraniteForCausalLM", "granite", permute_qk=True, family_config=_granite_config),
    "command-r": _ArchSpec("CohereForCausalLM", "cohere", permute_qk=False, family_config=_cohere_config,
                           partial_rotary=True),
    "cohere2": _ArchSpec("Cohere2ForCausalLM", "cohere2", permute_qk=False, family_config=_cohere_config,
                         partial_rotary=True),
    "gpt-oss": _ArchSpec("GptOssForCausalLM", "gpt_oss", permute_qk=False, family_config=_gpt_oss_config,
                         hf_stacked_experts=True,
                         layer_tensors=(("post_attention_norm", "post_attention_layernorm"),
                                        ("attn_sinks", "self_attn.sinks"), ("ffn_gate_inp", "mlp.router"))),
    # llama.cpp's deepseek2 is DeepSeek-V3's layout too (sigmoid routing); its kv_b is stored split as
    # attn_k_b (transposed) and attn_v_b by newer converters, joined back here.
    "deepseek2": _ArchSpec("DeepseekV3ForCausalLM", "deepseek_v3", permute_qk=False, family_config=_deepseek_config,
                           layer_tensors=(("attn_q_a", "self_attn.q_a_proj"),
                                          ("attn_q_a_norm", "self_attn.q_a_layernorm"),
                                          ("attn_q_b", "self_attn.q_b_proj"),
                                          ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"),
                                          ("attn_kv_a_norm", "self_attn.kv_a_layernorm"),
                                          ("attn_kv_b", "self_attn.kv_b_proj"),
                                          ("exp_probs_b", "mlp.gate.e_score_correction_bias"),
                                          ("ffn_gate_shexp", "mlp.shared_experts.gate_proj"),
                                          ("ffn_up_shexp", "mlp.shared_experts.up_proj"),
                                          ("ffn_down_shexp", "mlp.shared_experts.down_proj"))),
}
# Config-carrying tensors: read into the config by the family (Phi-3's LongRoPE factors), not weights.
_CONFIG_TENSORS = {"rope_factors_long.weight", "rope_factors_short.weight"}
# llama.cpp's MoE graphs: whether the top-k routing weights are renormalised (its norm_w), per architecture.
_MOE_RENORMALISE = {"llama": True, "qwen2moe": False, "qwen3moe": True, "gpt-oss": True}
# HF parameters that are not a module's weight: GGUF's blk.N.attn_sinks.weight is HF's self_attn.sinks.
_BARE_PARAMETERS = {"self_attn.sinks", "mlp.gate.e_score_correction_bias"}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}



class _FastGGUFReader(GGUFReader):
    """GGUFReader that parses metadata from a plain ndarray view of its memmap.

    The stock reader slices ``np.memmap`` once per metadata item, and memmap's per-slice
    bookkeeping makes the ~100k tokenizer strings of a small model take ~5 s to parse.
    Slicing a plain view of the same mapping reads the same bytes about 3x faster.
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Memory-map and parse a GGUF file; pass the result to both readers below to parse once."""
    try:
        return _FastGGUFReader(path)
    except Exception:
        pass
    # The fast path leans on a gguf-py internal; the stock reader is always correct and raises any
    # genuine problem with the file, which gguf-py reports without naming it.
    try:
        return GGUFReader(path)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - ValueError, struct.error, IndexError...: all mean a bad file
        raise ValueError(f"{path} cannot be read as a GGUF file ({type(e).__name__}: {e}); it is truncated "
                         f"or corrupt: download it again.") from None


def _as_reader(source: GGUFSource) -> GGUFReader:
    return source if isinstance(source, GGUFReader) else open_gguf(source)


def _file_name(reader: GGUFReader) -> str:
    return str(getattr(reader.data, "filename", None) or "the GGUF file")


def _metadata(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"{_file_name(reader)}: GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _architecture(reader: GGUFReader) -> tuple[str, _ArchSpec]:
    arch = _metadata(reader, "general.architecture")
    spec = _ARCHS.get(arch)
    if spec is None:
        raise ValueError(
            f"{_file_name(reader)}: Unsupported GGUF architecture {arch!r}; kvserve can load: "
            f"{', '.join(sorted(_ARCHS))}."
        )
    return arch, spec


def _tensor_names(reader: GGUFReader) -> set[str]:
    return {t.name for t in reader.tensors}


def _vocab_size(reader: GGUFReader, arch: str) -> int:
    size = _metadata(reader, f"{arch}.vocab_size", None)
    if size is not None:
        return int(size)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return int(embed.shape[-1])  # GGUF shapes are (in, out): rows are the last dim


def _head_dim(reader: GGUFReader, arch: str, spec: _ArchSpec, hidden_size: int, num_heads: int) -> int:
    # key_length is explicit (Qwen3); llama GGUFs only record the rope dim, which is head_dim there.
    keys = ("attention.key_length",) if spec.partial_rotary else ("attention.key_length", "rope.dimension_count")
    for key in keys:
        value = _metadata(reader, f"{arch}.{key}", None)
        if value is not None:
            return int(value)
    return hidden_size // num_heads


def read_gguf_config(source: GGUFSource) -> dict:
    """An HF config.json-style dict built from a GGUF file's metadata."""
    reader = _as_reader(source)
    arch, spec = _architecture(reader)

    def arch_key(key: str, default: Any = _MISSING) -> Any:
        return _metadata(reader, f"{arch}.{key}", default)

    hidden_size = int(arch_key("embedding_length"))
    num_heads = int(arch_key("attention.head_count"))
    rope_theta = float(arch_key("rope.freq_base", 10000.0))
    tensors = _tensor_names(reader)
    config = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": hidden_size,
        "intermediate_size": int(arch_key("feed_forward_length")),
        "num_hidden_layers": int(arch_key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(arch_key("attention.head_count_kv", num_heads)),
        "head_dim": _head_dim(reader, arch, spec, hidden_size, num_heads),
        "rms_norm_eps": _norm_eps(reader, arch),
        "rope_theta": rope_theta,
        # transformers >= 5 reads rope settings from here; older versions from rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(arch_key("context_length")),
        "vocab_size": _vocab_size(reader, arch),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": "float32",
    }
    if spec.partial_rotary:
        rotary = arch_key("rope.dimension_count", None)
        if rotary is not None and int(rotary) != config["head_dim"]:
            config["partial_rotary_factor"] = int(rotary) / config["head_dim"]
    if arch in ("command-r", "cohere2"):
        config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    if spec.family_config is not None:
        config.update(spec.family_config(_Metadata(reader, arch), config))
    experts = int(arch_key("expert_count", 0) or 0)
    if experts and arch in _MOE_RENORMALISE:  # (DeepSeek's family config holds its own MoE fields)
        config.update(_moe_config(arch, arch_key, experts, config["intermediate_size"]))
    for name in ("bos", "eos"):
        token_id = _metadata(reader, f"tokenizer.ggml.{name}_token_id", None)
        if token_id is not None:
            config[f"{name}_token_id"] = int(token_id)
    return config


def _norm_eps(reader: GGUFReader, arch: str) -> float:
    # RMSNorm families record layer_norm_rms_epsilon; LayerNorm ones (Command-R) layer_norm_epsilon.
    for key in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
        value = _metadata(reader, f"{arch}.{key}", None)
        if value is not None:
            return float(value)
    raise ValueError(f"{_file_name(reader)}: GGUF metadata key {arch + '.attention.layer_norm_rms_epsilon'!r} "
                     f"is missing")


def _moe_config(arch: str, arch_key, experts: int, intermediate_size: int) -> dict:
    """The HF MoE config fields of a GGUF (llama.cpp's MoE architectures make every layer sparse)."""
    moe = {"num_experts": experts, "num_experts_per_tok": int(arch_key("expert_used_count")),
           "norm_topk_prob": _MOE_RENORMALISE[arch],
           "moe_intermediate_size": int(arch_key("expert_feed_forward_length", intermediate_size)),
           "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch == "gpt-oss":  # HF's gpt-oss config names the expert width intermediate_size
        moe.update(num_local_experts=experts, intermediate_size=moe["moe_intermediate_size"])
    if arch == "llama":  # Mixtral: llama with experts
        moe.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts)
    shared = arch_key("expert_shared_feed_forward_length", None)
    if shared:
        moe["shared_expert_intermediate_size"] = int(shared)
    return moe


def layer_tensor_names(spec: _ArchSpec | None = None) -> dict[str, str]:
    """GGUF layer tensor name -> HF module, for one architecture (default: the llama layout)."""
    return {**_LAYER_TENSORS, **dict(spec.layer_tensors)} if spec is not None else _LAYER_TENSORS


def gguf_to_hf_name(gguf_name: str, spec: _ArchSpec | None = None) -> str:
    """Map a llama.cpp tensor name (``blk.3.attn_q.weight``) to its transformers name."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    layer_tensors = layer_tensor_names(spec)
    if len(parts) == 1 and parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        if layer_tensors[parts[2]] in _BARE_PARAMETERS:
            return f"model.layers.{int(parts[1])}.{layer_tensors[parts[2]]}"
        return f"model.layers.{int(parts[1])}.{layer_tensors[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known transformers equivalent")


def _unpermute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # Inverse of llama.cpp convert_hf_to_gguf's permute(); same as transformers' LlamaTensorProcessor.
    half_dim = weights.shape[0] // num_heads // 2
    split = weights.reshape(num_heads, half_dim, 2, *weights.shape[1:])
    return split.swapaxes(2, 1).reshape(weights.shape)


def _dequantize_tensor(tensor) -> np.ndarray:
    weights = dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dims innermost first; HF (out_features, in_features) is the reverse.
    weights = weights.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    if weights.dtype != np.float32:
        weights = weights.astype(np.float32)
    if not weights.flags.writeable:
        # F32 tensors come back as views of the read-only mmap; own the memory.
        weights = weights.copy()
    return weights


def iter_gguf_weights(source: GGUFSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (transformers name, float32 tensor) for every tensor of a GGUF file.

    ``lm_head.weight`` is yielded only when the file stores one (untied embeddings).
    """
    reader = _as_reader(source)
    _, spec = _architecture(reader)
    config = read_gguf_config(reader) if spec.permute_qk else None
    gate_up_halves: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    latent_halves: dict[str, dict[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        if tensor.name.endswith((".attn_k_b.weight", ".attn_v_b.weight")):
            yield from _joined_kv_b(tensor.name, _dequantize_tensor(tensor), latent_halves)
            continue
        stem, suffix = tensor.name.rsplit(".", 1)
        if stem.split(".")[-1] in _EXPERT_TENSORS and spec.hf_stacked_experts:
            yield from _hf_stacked_expert(stem, suffix, _dequantize_tensor(tensor), gate_up_halves)
            continue
        if stem.split(".")[-1] in _EXPERT_TENSORS:
            if suffix != "weight":
                raise ValueError(f"{_file_name(reader)}: GGUF tensor {tensor.name!r}: expert biases are "
                                 f"read for gpt-oss only")
            yield from _per_expert(stem, _dequantize_tensor(tensor))
            continue
        try:
            hf_name = gguf_to_hf_name(tensor.name, spec)
        except ValueError as e:
            raise ValueError(f"{_file_name(reader)}: {e}") from None
        weights = _dequantize_tensor(tensor)
        if spec.norm_weights_plus_one and tensor.name.endswith("norm.weight"):
            weights -= 1.0  # HF's Gemma norms hold w and compute (1 + w)
        if hf_name.endswith("shared_expert_gate.weight") and weights.ndim == 1:
            weights = weights[None, :]  # llama.cpp stores the [1, hidden] gate as a vector
        if config is not None and ".attn_q." in tensor.name:
            weights = _unpermute_qk(weights, config["num_attention_heads"])
        elif config is not None and ".attn_k." in tensor.name:
            weights = _unpermute_qk(weights, config["num_key_value_heads"])
        yield hf_name, torch.from_numpy(np.ascontiguousarray(weights))
    for (layer, suffix), halves in gate_up_halves.items():
        have, lack = next(iter(halves)), ({"ffn_gate_exps", "ffn_up_exps"} - set(halves)).pop()
        raise ValueError(f"{_file_name(reader)}: blk.{layer}.{have}.{suffix} has no blk.{layer}.{lack}.{suffix}; "
                         f"gpt-oss's experts need both")
    for layer, halves in latent_halves.items():
        have, lack = next(iter(halves)), ({"attn_k_b", "attn_v_b"} - set(halves)).pop()
        raise ValueError(f"{_file_name(reader)}: blk.{layer}.{have}.weight has no blk.{layer}.{lack}.weight; "
                         f"DeepSeek's kv_b_proj needs both")


def _joined_kv_b(name: str, weights: np.ndarray, latent_halves: dict):
    """DeepSeek: attn_k_b [heads, rank, nope] and attn_v_b [heads, v, rank] back into HF's kv_b_proj
    [heads * (nope + v), rank] (per head, the k_nope rows then the v rows)."""
    _, layer, kind, _ = name.split(".")
    halves = latent_halves.setdefault(layer, {})
    halves[kind] = weights
    if len(halves) < 2:
        return
    del latent_halves[layer]
    k_b, v_b = halves["attn_k_b"].swapaxes(1, 2), halves["attn_v_b"]
    joined = np.concatenate([k_b, v_b], axis=1).reshape(-1, k_b.shape[2])
    yield f"model.layers.{int(layer)}.self_attn.kv_b_proj.weight", torch.from_numpy(np.ascontiguousarray(joined))


def _hf_stacked_expert(stem: str, suffix: str, stacked: np.ndarray, gate_up_halves: dict):
    """llama.cpp's split gpt-oss experts back into HF's stacked gate_up_proj / down_proj (and biases)."""
    _, layer, kind = stem.split(".")
    prefix = f"model.layers.{int(layer)}.mlp.experts"
    bias = suffix == "bias"
    if kind == "ffn_down_exps":  # [E, H, I] -> [E, I, H]; its bias [E, H] as is
        value = stacked if bias else stacked.swapaxes(1, 2)
        yield f"{prefix}.down_proj{'_bias' if bias else ''}", torch.from_numpy(np.ascontiguousarray(value))
        return
    halves = gate_up_halves.setdefault((layer, suffix), {})
    halves[kind] = stacked
    if len(halves) < 2:
        return
    del gate_up_halves[(layer, suffix)]
    gate, up = halves["ffn_gate_exps"], halves["ffn_up_exps"]  # [E, I, H] (weights) or [E, I] (biases)
    fused = np.stack([gate, up], axis=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])
    value = fused if bias else fused.swapaxes(1, 2)  # interleaved rows [E, 2I, H] -> HF's [E, H, 2I]
    yield f"{prefix}.gate_up_proj{'_bias' if bias else ''}", torch.from_numpy(np.ascontiguousarray(value))


def _per_expert(stem: str, stacked: np.ndarray) -> Iterator[tuple[str, torch.Tensor]]:
    """blk.N.ffn_gate_exps [E, out, in] -> model.layers.N.mlp.experts.e.gate_proj.weight for each expert e."""
    _, layer, kind = stem.split(".")
    proj = _EXPERT_TENSORS[kind]
    for e in range(stacked.shape[0]):
        yield (f"model.layers.{int(layer)}.mlp.experts.{e}.{proj}.weight",
               torch.from_numpy(np.ascontiguousarray(stacked[e])))
