"""The model facts the engine needs, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.model.config_schema import check_field_types, check_required_and_relations
from kvserve.model.registry import ARCHITECTURES, architecture_of, supported_names


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before rotary
    torch_dtype: str  # as the checkpoint declares it ("float32", "bfloat16", ...)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    sliding_window: int | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict, trust_remote_code: bool = False,
                     source: str = "config.json") -> "ModelConfig":
        """`source` names the file in errors (its path, or the .gguf the dict was read from)."""
        check_field_types(cfg, source)
        cfg = {k: v for k, v in cfg.items() if v is not None}  # null means absent: the defaults below apply
        arch = architecture_of(cfg)
        if arch not in ARCHITECTURES:
            remote = ""
            if cfg.get("auto_map"):
                # The repo ships its own modelling code (what --trust-remote-code would run in vLLM).
                remote = (" This model's architecture is defined by code in its repository (config.json has "
                          "auto_map); kvserve never runs code from a model repository"
                          + (", so --trust-remote-code cannot help." if trust_remote_code else "."))
            raise ValueError(
                f"Model architecture {arch!r} (model_type {cfg.get('model_type')!r}) is not supported.{remote} "
                f"Supported: {', '.join(supported_names())}."
            )
        check_required_and_relations(cfg, source)
        heads = cfg["num_attention_heads"]
        # transformers 5 nests rope settings in rope_parameters; older configs use rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling") or {}
        rope_theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_scaling = rope or dict(legacy_scaling) or None
        if rope_scaling is not None:
            rope_scaling.pop("rope_theta", None)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling = None if kind == "default" else rope_scaling
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", ""),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            sliding_window=sliding,
        )

    @classmethod
    def from_path(cls, model_path: str | Path, trust_remote_code: bool = False) -> "ModelConfig":
        return cls.from_hf_dict(load_hf_config_dict(model_path), trust_remote_code, config_source(model_path))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        return self.num_hidden_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h


def config_source(model_path: str | Path) -> str:
    """The file a model's config comes from, as errors name it."""
    path = Path(model_path)
    return f"{path} (GGUF metadata)" if path.suffix == ".gguf" else str(path / "config.json")


def load_hf_config_dict(model_path: str | Path) -> dict:
    """config.json of an HF directory, or the equivalent dict for a .gguf file."""
    path = Path(model_path)
    if path.suffix == ".gguf":
        from kvserve.model.gguf_loader import read_gguf_config

        return read_gguf_config(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"No config.json in {path}. Pass a Hugging Face model directory, a hub repo id or a .gguf file."
        )
    try:
        return json.loads(config_file.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{config_file} is not valid JSON ({e}). Fix or re-download the file.") from None
