"""The config.json fields kvserve reads, with their types and ranges, checked before any model is built.

A malformed config fails here with the file, the field and the value, not as a KeyError, a TypeError or a
oneDNN error deep inside torch. A field the model code reads gets one line in FIELDS ("a.b" for a key inside
an object); a rule between fields gets one line in RELATIONS. Torch-free, like the registry, so `kvserve plan` checks configs the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    expected: str  # completes "it must be ..."
    accepts: Callable[[object], bool]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a size


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


POSITIVE_INT = Rule("an integer >= 1", lambda v: _is_int(v) and v >= 1)
NON_NEGATIVE_INT = Rule("an integer >= 0", lambda v: _is_int(v) and v >= 0)
POSITIVE_NUMBER = Rule("a finite number > 0", lambda v: _is_number(v) and v > 0)
NUMBER = Rule("a finite number", _is_number)
BOOL = Rule("true or false", lambda v: isinstance(v, bool))
STRING = Rule("a string", lambda v: isinstance(v, str))
OBJECT = Rule("a JSON object", lambda v: isinstance(v, dict))
STRINGS = Rule("a list of strings", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v))
INDICES = Rule("a list of integers >= 0", lambda v: isinstance(v, list) and all(NON_NEGATIVE_INT.accepts(i) for i in v))
TOKEN_IDS = Rule("a token id or a list of token ids (integers >= 0)",
                 lambda v: NON_NEGATIVE_INT.accepts(v)
                 or (isinstance(v, list) and all(NON_NEGATIVE_INT.accepts(t) for t in v)))

REQUIRED, OPTIONAL = True, False

# key -> (rule, required). An optional key may be absent or null (HF writes "head_dim": null); a default applies.
FIELDS: dict[str, tuple[Rule, bool]] = {
    "architectures": (STRINGS, OPTIONAL),
    "model_type": (STRING, OPTIONAL),
    "hidden_size": (POSITIVE_INT, REQUIRED),
    "num_hidden_layers": (POSITIVE_INT, REQUIRED),
    "num_attention_heads": (POSITIVE_INT, REQUIRED),
    "num_key_value_heads": (POSITIVE_INT, OPTIONAL),
    "head_dim": (POSITIVE_INT, OPTIONAL),
    "intermediate_size": (POSITIVE_INT, REQUIRED),
    "vocab_size": (POSITIVE_INT, REQUIRED),
    "max_position_embeddings": (POSITIVE_INT, OPTIONAL),
    "rms_norm_eps": (POSITIVE_NUMBER, OPTIONAL),
    "layer_norm_eps": (POSITIVE_NUMBER, OPTIONAL),  # Cohere
    "logit_scale": (POSITIVE_NUMBER, OPTIONAL),  # Cohere
    "use_qk_norm": (BOOL, OPTIONAL),  # Cohere
    "rope_theta": (POSITIVE_NUMBER, OPTIONAL),
    "rope_scaling": (OBJECT, OPTIONAL),
    "rope_parameters": (OBJECT, OPTIONAL),
    "tie_word_embeddings": (BOOL, OPTIONAL),
    "attention_bias": (BOOL, OPTIONAL),
    "use_sliding_window": (BOOL, OPTIONAL),
    "sliding_window": (NON_NEGATIVE_INT, OPTIONAL),  # 0 or null: no window
    "torch_dtype": (STRING, OPTIONAL),
    "dtype": (STRING, OPTIONAL),
    "eos_token_id": (TOKEN_IDS, OPTIONAL),
    "bos_token_id": (NON_NEGATIVE_INT, OPTIONAL),
    "quantization_config": (OBJECT, OPTIONAL),
    "qkv_bias": (BOOL, OPTIONAL),
    "hidden_act": (STRING, OPTIONAL),
    "hidden_activation": (STRING, OPTIONAL),
    "partial_rotary_factor": (POSITIVE_NUMBER, OPTIONAL),
    # per-layer attention windows (Gemma 2/3, Qwen2/3, Mistral, Phi-3)
    "layer_types": (STRINGS, OPTIONAL),
    "sliding_window_pattern": (POSITIVE_INT, OPTIONAL),
    "max_window_layers": (NON_NEGATIVE_INT, OPTIONAL),
    "rope_local_base_freq": (POSITIVE_NUMBER, OPTIONAL),
    "attn_logit_softcapping": (POSITIVE_NUMBER, OPTIONAL),
    "final_logit_softcapping": (POSITIVE_NUMBER, OPTIONAL),
    "query_pre_attn_scalar": (POSITIVE_NUMBER, OPTIONAL),
    # Granite's multipliers
    "embedding_multiplier": (NUMBER, OPTIONAL),
    "residual_multiplier": (NUMBER, OPTIONAL),
    "attention_multiplier": (NUMBER, OPTIONAL),
    "logits_scaling": (NUMBER, OPTIONAL),
    # mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE)
    "num_experts": (NON_NEGATIVE_INT, OPTIONAL),
    "num_local_experts": (NON_NEGATIVE_INT, OPTIONAL),
    "num_experts_per_tok": (POSITIVE_INT, OPTIONAL),
    "moe_intermediate_size": (POSITIVE_INT, OPTIONAL),
    "shared_expert_intermediate_size": (NON_NEGATIVE_INT, OPTIONAL),
    "decoder_sparse_step": (NON_NEGATIVE_INT, OPTIONAL),
    "mlp_only_layers": (INDICES, OPTIONAL),
    "norm_topk_prob": (BOOL, OPTIONAL),
    # DeepSeek-V3: multi-head latent attention and its routing
    "kv_lora_rank": (POSITIVE_INT, OPTIONAL),
    "q_lora_rank": (POSITIVE_INT, OPTIONAL),  # null: a direct q_proj
    "qk_nope_head_dim": (POSITIVE_INT, OPTIONAL),
    "qk_rope_head_dim": (POSITIVE_INT, OPTIONAL),
    "v_head_dim": (POSITIVE_INT, OPTIONAL),
    "rope_interleave": (BOOL, OPTIONAL),
    "n_routed_experts": (NON_NEGATIVE_INT, OPTIONAL),
    "n_shared_experts": (NON_NEGATIVE_INT, OPTIONAL),
    "n_group": (POSITIVE_INT, OPTIONAL),
    "topk_group": (POSITIVE_INT, OPTIONAL),
    "routed_scaling_factor": (POSITIVE_NUMBER, OPTIONAL),
    "first_k_dense_replace": (NON_NEGATIVE_INT, OPTIONAL),
    # gpt-oss: its experts' clamped SwiGLU
    "swiglu_alpha": (POSITIVE_NUMBER, OPTIONAL),
    "swiglu_limit": (POSITIVE_NUMBER, OPTIONAL),
}
# Rope settings: `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5, per layer type for
# Gemma 3) hold the same keys.
ROPE_SETTINGS = ("rope_scaling", "rope_parameters", "rope_parameters.full_attention",
                 "rope_parameters.sliding_attention")
for _rope in ROPE_SETTINGS:
    FIELDS.setdefault(_rope, (OBJECT, OPTIONAL))
    FIELDS.update({
        f"{_rope}.partial_rotary_factor": (POSITIVE_NUMBER, OPTIONAL),
        f"{_rope}.rope_theta": (POSITIVE_NUMBER, OPTIONAL),
        f"{_rope}.rope_type": (STRING, OPTIONAL),
        f"{_rope}.type": (STRING, OPTIONAL),
        f"{_rope}.factor": (POSITIVE_NUMBER, OPTIONAL),
        f"{_rope}.low_freq_factor": (POSITIVE_NUMBER, OPTIONAL),
        f"{_rope}.high_freq_factor": (POSITIVE_NUMBER, OPTIONAL),
        f"{_rope}.original_max_position_embeddings": (POSITIVE_INT, OPTIONAL),
        # YaRN (gpt-oss, DeepSeek)
        f"{_rope}.beta_fast": (POSITIVE_NUMBER, OPTIONAL),
        f"{_rope}.beta_slow": (POSITIVE_NUMBER, OPTIONAL),
        f"{_rope}.mscale": (NUMBER, OPTIONAL),
        f"{_rope}.mscale_all_dim": (NUMBER, OPTIONAL),
        f"{_rope}.truncate": (BOOL, OPTIONAL),
    })


def value_at(cfg: dict, key: str):
    """cfg["a"]["b"] for key "a.b"; None where a level is absent or not an object (its own rule reports that)."""
    for part in key.split("."):
        if not isinstance(cfg, dict):
            return None
        cfg = cfg.get(part)
    return cfg


def _present(cfg: dict, key: str) -> bool:
    return value_at(cfg, key) is not None


def _rope_kind(rope: dict) -> str:
    return rope.get("rope_type") or rope.get("type") or "default"


def _rope_has_what_its_kind_needs(rope) -> bool:
    if not isinstance(rope, dict):  # absent
        return True
    kind = _rope_kind(rope)
    if kind in ("linear", "llama3", "yarn") and rope.get("factor") is None:
        return False
    if kind == "yarn":
        return rope.get("original_max_position_embeddings") is not None
    if kind == "llama3":
        low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        return rope.get("original_max_position_embeddings") is not None and low < high
    return True


# (the keys it reads, holds(cfg), what must hold). Checked once every key it reads has passed FIELDS.
RELATIONS: list[tuple[tuple[str, ...], Callable[[dict], bool], str]] = [
    (("hidden_size", "num_attention_heads"),
     lambda c: _present(c, "head_dim") or c["hidden_size"] % c["num_attention_heads"] == 0,
     "hidden_size must be divisible by num_attention_heads (or head_dim must be given)"),
    (("num_attention_heads", "num_key_value_heads"),
     lambda c: not _present(c, "num_key_value_heads") or c["num_attention_heads"] % c["num_key_value_heads"] == 0,
     "num_attention_heads must be a multiple of num_key_value_heads (each KV head serves a whole group)"),
    (("num_hidden_layers", "layer_types"),
     lambda c: not _present(c, "layer_types") or len(c["layer_types"]) == c["num_hidden_layers"],
     "layer_types must name one attention type per layer"),
    (("num_experts", "num_local_experts", "num_experts_per_tok"),
     lambda c: not _present(c, "num_experts_per_tok")
     or c["num_experts_per_tok"] <= (c.get("num_experts") or c.get("num_local_experts") or c["num_experts_per_tok"]),
     "num_experts_per_tok must be at most the number of experts"),
    (("architectures", "num_experts", "moe_intermediate_size", "num_experts_per_tok"),
     lambda c: not (c.get("num_experts") or c.get("num_local_experts"))
     or {"MixtralForCausalLM", "GptOssForCausalLM"} & set(c.get("architectures") or []) or (_present(c, "moe_intermediate_size") and _present(c, "num_experts_per_tok")),
     "a mixture-of-experts config (num_experts > 0) needs moe_intermediate_size and num_experts_per_tok"),
    (("architectures", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
     lambda c: "DeepseekV3ForCausalLM" not in (c.get("architectures") or []) or (
         all(_present(c, k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
         and (c["kv_lora_rank"] + c["qk_rope_head_dim"]) % 2 == 0),
     "DeepSeek-V3's latent attention needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim "
     "(kv_lora_rank + qk_rope_head_dim even: the cache splits that entry in two)"),
    (("n_routed_experts", "n_group", "topk_group"),
     lambda c: not c.get("n_routed_experts") or (c["n_routed_experts"] % (c.get("n_group") or 1) == 0
                                                   and (c.get("topk_group") or 1) <= (c.get("n_group") or 1)),
     "n_routed_experts must split into n_group equal groups, and topk_group must be at most n_group"),
    *(((rope,), lambda c, rope=rope: _rope_has_what_its_kind_needs(value_at(c, rope)),
        f"{rope} of rope_type linear needs factor; yarn needs factor and original_max_position_embeddings; "
        f"llama3 needs factor, original_max_position_embeddings and low_freq_factor < high_freq_factor") for rope in ROPE_SETTINGS),
]


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_field_types(cfg, source: str) -> None:
    """Every field that is present has its type and range (required keys are checked later: an unsupported
    architecture is reported as such, not as its first missing key)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{source} must hold a JSON object, not {type(cfg).__name__}.")
    for key, (rule, _) in FIELDS.items():  # a parent key comes before its children
        value = value_at(cfg, key)
        if value is not None and not rule.accepts(value):
            raise ValueError(f"{source}: {key} is {_shown(value)} ({type(value).__name__}); "
                             f"it must be {rule.expected}. Fix the file.")


def check_required_and_relations(cfg: dict, source: str) -> None:
    for key, (rule, required) in FIELDS.items():
        if required and value_at(cfg, key) is None:
            raise ValueError(f"{source} has no {key!r}; it must be {rule.expected}. Fix the file.")
    for keys, holds, what in RELATIONS:
        if not holds(cfg):
            values = ", ".join(f"{k} {_shown(value_at(cfg, k))}" for k in keys)
            raise ValueError(f"{source}: {what}; got {values}. Fix the file.")
