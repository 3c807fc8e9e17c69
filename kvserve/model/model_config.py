"""The model facts the engine needs, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.core.kv_cache_groups import KVCacheGroup, kv_cache_groups
from kvserve.model.config_schema import check_field_types, check_required_and_relations
from kvserve.model.registry import ARCHITECTURES, MISSING, architecture_of, supported_names


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
    # Mixture of experts (num_experts 0: a dense model). Routed experts each have moe_intermediate_size
    # features; layers listed in mlp_only_layers (and those decoder_sparse_step skips) keep a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert behind a sigmoid gate (0: none)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # How the router turns logits into top-k weights: "softmax_topk" (softmax over all experts, then top-k) or
    # "topk_softmax" (gpt-oss: top-k logits, then a softmax over those k).
    moe_router: str = "softmax_topk"
    moe_bias: bool = False  # gpt-oss: biases on the router and on every expert's projections
    # The experts' gate activation: "silu" (silu(gate) * up) or "swiglu_oai" (gpt-oss: clamped at
    # swiglu_limit, gate * sigmoid(swiglu_alpha * gate) * (up + 1)).
    moe_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # gpt-oss attention: a learned logit per head joins each softmax's denominator (attention sinks); o_proj
    # has a bias too.
    attention_sinks: bool = False
    o_proj_bias: bool = False
    # DeepSeek-V3 multi-head latent attention (kv_lora_rank > 0): the KV cache holds, per token and layer, the
    # compressed latent (kv_lora_rank) and one shared rope key (qk_rope_head_dim), not per-head K/V; heads
    # have qk_nope_head_dim + qk_rope_head_dim query/key dims and v_head_dim value dims; q_lora_rank 0: a
    # direct q_proj. Its routing: sigmoid scores, the best topk_group of n_group expert groups, the top-k
    # weights scaled by routed_scaling_factor; an ungated shared expert.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert
    # --- Per-layer attention, and what the Gemma / Phi-3 families differ in (read by _family_fields) ---
    layer_windows: list[int | None] = field(default_factory=list)  # per layer: its window, or None (full)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> C * tanh(scores / C)
    final_logit_softcapping: float | None = None  # Gemma 2: logits -> C * tanh(logits / C)
    query_pre_attn_scalar: float | None = None  # Gemma: softmax scale = this ** -0.5 instead of head_dim ** -0.5
    rope_local_theta: float | None = None  # Gemma 3: the rope base of the windowed layers (no scaling there)
    partial_rotary_factor: float = 1.0  # Phi-4-mini: rotary on the first head_dim * factor dims only
    hidden_act: str = "silu"  # the gate activation (Gemma: gelu_pytorch_tanh)
    # Granite: embeddings * embedding_multiplier, sublayer outputs * residual_multiplier before the residual
    # add, softmax scale attention_multiplier, logits / logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    logit_scale: float = 1.0  # Cohere: logits * logit_scale
    rope_windowed_layers_only: bool = False  # Cohere 2: full-attention layers have no position encoding

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_cache_num_heads(self) -> int:
        """KV heads as the cache stores them (MLA: one latent entry per token, shared by every head)."""
        return 1 if self.uses_mla else self.num_key_value_heads

    @property
    def kv_cache_head_dim(self) -> int:
        """Values per head in each of the cache's two planes; MLA splits its latent + rope key entry across
        the K and V planes (half in each), so a token costs exactly kv_lora_rank + qk_rope_head_dim values."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) // 2 if self.uses_mla else self.head_dim

    @property
    def has_windowed_layers(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def kv_cache_groups(self) -> list[KVCacheGroup]:
        """The layers that share one block table per request (core/kv_cache_groups.py): one group where
        every layer attends alike; full and windowed groups for interleaved models (Gemma)."""
        return kv_cache_groups(self.layer_windows or [None] * self.num_hidden_layers)

    @property
    def kv_cache_group_windows(self) -> list[int | None]:
        return [g.window for g in self.kv_cache_groups]

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
            if arch in MISSING:
                remote = f" {MISSING[arch]}." + remote
            raise ValueError(
                f"Model architecture {arch!r} (model_type {cfg.get('model_type')!r}) is not supported.{remote} "
                f"Supported: {', '.join(supported_names())}."
            )
        check_required_and_relations(cfg, source)
        heads = cfg["num_attention_heads"]
        # transformers 5 nests rope settings in rope_parameters; older configs use rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        if "full_attention" in rope:  # per layer type (Gemma 3): the full layers' rope is the model's rope
            rope = dict(rope["full_attention"] or {})
        legacy_scaling = cfg.get("rope_scaling") or {}
        rope_theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_scaling = rope or dict(legacy_scaling) or None
        if rope_scaling is not None:
            rope_scaling.pop("rope_theta", None)
            rope_scaling.pop("partial_rotary_factor", None)  # a rotary dimension, not a scaling (Phi-4-mini)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling = None if kind == "default" else rope_scaling
            if kind == "longrope":  # Phi-3 keeps these two lengths beside rope_scaling
                rope_scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
                rope_scaling["max_position_embeddings"] = cfg.get("max_position_embeddings")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        family = _family_fields(arch, cfg)
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            # MLA: the query/key head (its config's head_dim is the rope part)
            head_dim=(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] if cfg.get("kv_lora_rank")
                      else cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", cfg.get("layer_norm_eps", 1e-6)),  # (Cohere: a LayerNorm's)
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch in _QKV_BIAS))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
            or bool(arch == "CohereForCausalLM" and cfg.get("use_qk_norm")),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", ""),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            **family,
            **_moe_fields(arch, cfg),
        )

    @classmethod
    def from_path(cls, model_path: str | Path, trust_remote_code: bool = False) -> "ModelConfig":
        return cls.from_hf_dict(load_hf_config_dict(model_path), trust_remote_code, config_source(model_path))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K/V bytes one token of context costs in every layer (a windowed layer's blocks are freed later)."""
        return self.num_hidden_layers * 2 * self.kv_cache_num_heads * self.kv_cache_head_dim * dtype_bytes

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.mlp_only_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def num_params(self) -> int:
        return self._params(self.num_experts)

    def num_active_params(self) -> int:
        """Parameters one token's forward pass multiplies with: a MoE layer counts only its top-k experts."""
        return self._params(self.num_experts_per_tok)

    def moe_expert_params(self) -> int:
        """The routed experts' weights of the whole model (what expert parallelism splits)."""
        return self.num_moe_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def _params(self, experts_per_moe_layer: int) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attention = h * (q + 2 * kv) + q * h + 2 * h
        if self.uses_mla:
            attention = self._mla_attention_params()
        attention += (q + 2 * kv if self.attention_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        attention += (h if self.o_proj_bias else 0) + (self.num_attention_heads if self.attention_sinks else 0)
        moe = self.num_moe_layers
        dense_mlps = (self.num_hidden_layers - moe) * 3 * h * i
        shared = 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_gated else 0) \
            if self.shared_expert_intermediate_size else 0
        expert = 3 * h * self.moe_intermediate_size + (2 * self.moe_intermediate_size + h if self.moe_bias else 0)
        # gpt-oss's router bias; DeepSeek's score correction bias
        router_bias = self.moe_bias or self.moe_router == "sigmoid_grouped"
        router = h * self.num_experts + (self.num_experts if router_bias else 0)
        routed = moe * (experts_per_moe_layer * expert + router + shared)
        return (self.num_hidden_layers * attention + dense_mlps + routed
                + v * h * (1 if self.tie_word_embeddings else 2) + h)


    def _mla_attention_params(self) -> int:
        h, heads, r, rope = self.hidden_size, self.num_attention_heads, self.kv_lora_rank, self.qk_rope_head_dim
        qk = self.qk_nope_head_dim + rope
        q_rank = self.q_lora_rank
        q = h * q_rank + q_rank + q_rank * heads * qk if q_rank else h * heads * qk
        kv = h * (r + rope) + r + r * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h + 2 * h


# bias on q/k/v unless the config says otherwise
_QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "GptOssForCausalLM")


def _moe_fields(arch: str, cfg: dict) -> dict:
    """The MoE fields of a config.json (HF's names differ by family; transformers 5 saves Qwen3-MoE's expert
    count as num_local_experts, Qwen's own checkpoints as num_experts)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if not experts:
        return {}
    layers = cfg["num_hidden_layers"]
    if arch == "MixtralForCausalLM":  # every layer sparse, experts of intermediate_size, top-k renormalised
        return dict(num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    if arch == "DeepseekV3ForCausalLM":  # dense first_k_dense_replace layers, then sparse
        shared = cfg.get("n_shared_experts", 0) or 0
        return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"], moe_router="sigmoid_grouped",
                    shared_expert_intermediate_size=cfg["moe_intermediate_size"] * shared, shared_expert_gated=False,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), n_group=cfg.get("n_group", 1) or 1,
                    topk_group=cfg.get("topk_group", 1) or 1,
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                    mlp_only_layers=list(range(min(cfg.get("first_k_dense_replace", 0) or 0, layers))))
    if arch == "GptOssForCausalLM":  # every layer sparse; a softmax over the top-k logits; biased experts
        return dict(num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 4),
                    moe_intermediate_size=cfg["intermediate_size"], moe_router="topk_softmax", moe_bias=True,
                    moe_activation="swiglu_oai", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = sorted(set(cfg.get("mlp_only_layers") or []) | {i for i in range(layers) if (i + 1) % step})
    return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) or 0,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), mlp_only_layers=dense)


def config_source(model_path: str | Path) -> str:
    """The file a model's config comes from, as errors name it."""
    path = Path(model_path)
    return f"{path} (GGUF metadata)" if path.suffix == ".gguf" else str(path / "config.json")


_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _layer_windows(arch: str, cfg: dict) -> list[int | None]:
    """Each layer's attention window, as HF transformers' modelling code applies it: from `layer_types`
    where the config has them (transformers 5 writes them for Gemma 2/3, Qwen2/3), else the family's rule."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", True):
        return [None] * n
    types = cfg.get("layer_types")
    if types is None and arch == "Gemma2ForCausalLM":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    elif types is None and arch in ("Gemma3ForCausalLM", "Cohere2ForCausalLM"):
        pattern = cfg.get("sliding_window_pattern", 6 if arch == "Gemma3ForCausalLM" else 4)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    elif types is None and arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = cfg.get("max_window_layers", n)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    elif types is None:  # Mistral, Phi-3: every layer
        types = ["sliding_attention"] * n
    if len(types) != n:
        raise ValueError(f"config.json has {len(types)} layer_types for {n} layers")
    return [int(window) if t == "sliding_attention" else None for t in types]


def _family_fields(arch: str, cfg: dict) -> dict:
    """The ModelConfig fields of the per-layer-attention block above."""
    windows = _layer_windows(arch, cfg)
    fields = {
        "layer_windows": windows,
        "sliding_window": next((w for w in windows if w is not None), None),
        "partial_rotary_factor": float(cfg.get("partial_rotary_factor")
                                       or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0),
        "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
    }
    if arch in _GEMMA:
        fields["attn_logit_softcapping"] = cfg.get("attn_logit_softcapping")
        fields["final_logit_softcapping"] = cfg.get("final_logit_softcapping")
        fields["query_pre_attn_scalar"] = cfg.get("query_pre_attn_scalar")
    if arch == "DeepseekV3ForCausalLM":
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            fields[name] = int(cfg[name])
        fields["q_lora_rank"] = int(cfg.get("q_lora_rank") or 0)
        fields["rope_interleave"] = bool(cfg.get("rope_interleave", True))
    if arch == "GptOssForCausalLM":
        fields["attention_sinks"] = True
        fields["o_proj_bias"] = bool(cfg.get("attention_bias", True))  # the o_proj bias goes with the q/k/v ones
    if arch == "GraniteForCausalLM":
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            if cfg.get(name) is not None:
                fields[name] = float(cfg[name])
    if arch in ("CohereForCausalLM", "Cohere2ForCausalLM"):
        fields["logit_scale"] = float(cfg.get("logit_scale", 1.0))
        fields["rope_windowed_layers_only"] = arch == "Cohere2ForCausalLM"
    if arch == "Gemma3ForCausalLM":
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
        fields["rope_local_theta"] = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)
    return fields


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
