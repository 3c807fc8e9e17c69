"""The config.json fields kvserve reads, with their types and ranges, checked before any model is built.

A malformed config fails here with the file, the field and the value, not as a KeyError, a TypeError or a
oneDNN error deep inside torch. A field the model code reads gets one line in FIELDS; a rule between fields
gets one line in RELATIONS. Torch-free, like the registry, so `kvserve plan` checks configs the same way.
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
BOOL = Rule("true or false", lambda v: isinstance(v, bool))
STRING = Rule("a string", lambda v: isinstance(v, str))
OBJECT = Rule("a JSON object", lambda v: isinstance(v, dict))
STRINGS = Rule("a list of strings", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v))
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
}


def _present(cfg: dict, key: str) -> bool:
    return cfg.get(key) is not None


# (the keys it reads, holds(cfg), what must hold). Checked once every key it reads has passed FIELDS.
RELATIONS: list[tuple[tuple[str, ...], Callable[[dict], bool], str]] = [
    (("hidden_size", "num_attention_heads"),
     lambda c: _present(c, "head_dim") or c["hidden_size"] % c["num_attention_heads"] == 0,
     "hidden_size must be divisible by num_attention_heads (or head_dim must be given)"),
    (("num_attention_heads", "num_key_value_heads"),
     lambda c: not _present(c, "num_key_value_heads") or c["num_attention_heads"] % c["num_key_value_heads"] == 0,
     "num_attention_heads must be a multiple of num_key_value_heads (each KV head serves a whole group)"),
]


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_field_types(cfg, source: str) -> None:
    """Every field that is present has its type and range (required keys are checked later: an unsupported
    architecture is reported as such, not as its first missing key)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{source} must hold a JSON object, not {type(cfg).__name__}.")
    for key, (rule, _) in FIELDS.items():
        value = cfg.get(key)
        if value is not None and not rule.accepts(value):
            raise ValueError(f"{source}: {key} is {_shown(value)} ({type(value).__name__}); "
                             f"it must be {rule.expected}. Fix the file.")


def check_required_and_relations(cfg: dict, source: str) -> None:
    for key, (rule, required) in FIELDS.items():
        if required and cfg.get(key) is None:
            raise ValueError(f"{source} has no {key!r}; it must be {rule.expected}. Fix the file.")
    for keys, holds, what in RELATIONS:
        if not holds(cfg):
            values = ", ".join(f"{k} {_shown(cfg.get(k))}" for k in keys)
            raise ValueError(f"{source}: {what}; got {values}. Fix the file.")
