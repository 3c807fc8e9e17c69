"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) over a paged KV cache.

Inputs are one flat batch: all scheduled tokens of all requests concatenated, [T]. Attention reads
and writes the cache through the backend, using the step's AttentionMetadata passed down explicitly.
Per-layer attention options come from the config (each layer's window, a logit soft cap, the softmax
scale, the rope base of windowed layers, partial rotary); families that differ further (Gemma, Phi-3)
subclass the hooks below in their own files.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import get_parallel_state
from kvserve.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    as_tensor,
    use_fused_kernels,
)
from kvserve.model.model_config import ModelConfig
from kvserve.model.moe import SparseMoeBlock
from kvserve.ops.attention_backend import AttentionBackend
from kvserve.ops.attention_metadata import AttentionMetadata


def _quant_method(quant_config, prefix: str):
    """The linear method a quantization config gives the layer named `prefix` (None: unquantized)."""
    return quant_config.get_quant_method(prefix) if quant_config is not None else None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, quant_config=None,
                 prefix: str = "", layer_idx: int = 0, norm_cls: type = RMSNorm):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = cfg.attention_multiplier or (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sliding_window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        # The KV cache group whose block tables this layer's K/V live in (AttentionMetadata.for_group).
        self.kv_cache_group = next(
            (g for g, group in enumerate(cfg.kv_cache_groups) if layer_idx in group.layers), 0)
        self.logits_soft_cap = cfg.attn_logit_softcapping
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias,
                                          quant_method=_quant_method(quant_config, f"{prefix}.qkv_proj"))
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias,
                                        quant_method=_quant_method(quant_config, f"{prefix}.o_proj"))
        # gpt-oss: a learned logit per head that joins its softmax's denominator; fp32, as the kernels read it.
        self.sinks = None
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        if cfg.qk_norm:
            self.q_norm = norm_cls(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm_cls(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.norm_whole_projection = False  # q/k norm per head (Qwen3, Gemma 3), or over the projection
        self.rotary = rotary
        self.backend = backend
        # FP8 KV cache: K/V are stored as k / k_scale in e4m3. From the checkpoint when it has them, else 1.0,
        # or computed from the first batch (--calculate-kv-scales); unused with a 16/32-bit cache.
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32))
        self.calculate_kv_scales = False

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        norms = None
        if self.q_norm is not None and self.norm_whole_projection:  # OLMo 2: over all heads at once
            q, k = self.q_norm(q.reshape(-1, self.q_size)), self.k_norm(k.reshape(-1, self.kv_size))
            q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        elif isinstance(self.q_norm, RMSNorm) and isinstance(self.rotary, RotaryEmbedding):
            norms = (self.q_norm, self.k_norm)  # per head (Qwen3, Gemma 3): normed in the rotary's own pass
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k, norms=norms) if norms else self.rotary(positions, q, k)
        if self.calculate_kv_scales:
            self._calculate_kv_scales(k, v)
        out = self.backend.forward(q, k, v, kv_cache, meta.for_group(self.kv_cache_group), self.scale,
                                   k_scale=self.k_scale, v_scale=self.v_scale, sliding_window=self.sliding_window,
                                   logits_soft_cap=self.logits_soft_cap, sinks=self.sinks)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _load_sinks(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """This rank's heads of the checkpoint's [num_attention_heads] sinks."""
        from kvserve.model.layers import copy_into

        rank = get_parallel_state().tp_rank
        copy_into(param.data, loaded.narrow(0, rank * self.num_heads, self.num_heads), "sinks")

    # vLLM's rule: max |k| maps to 200 and max |v| to 100 (e4m3's largest value is 448), once.
    K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0

    def _calculate_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_scale.copy_((k.abs().amax().float() / self.K_SCALE_RANGE).clamp(min=1e-6).reshape(1))
        self.v_scale.copy_((v.abs().amax().float() / self.V_SCALE_RANGE).clamp(min=1e-6).reshape(1))
        self.calculate_kv_scales = False


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, quant_config=None, prefix: str = "", intermediate_size: int | None = None,
                 reduce_results: bool = True):
        """intermediate_size: default the config's (a MoE shared expert has its own); reduce_results=False
        leaves the all-reduce to the caller."""
        super().__init__()
        if cfg.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden activation {cfg.hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")
        self.gelu_tanh = cfg.hidden_act == "gelu_pytorch_tanh"
        intermediate_size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [intermediate_size] * 2,
                                                       quant_method=_quant_method(quant_config, f"{prefix}.gate_up_proj"))
        self.intermediate = self.gate_up_proj.output_partition_sizes[0]  # this rank's share
        self.down_proj = RowParallelLinear(intermediate_size, cfg.hidden_size, reduce_results=reduce_results,
                                           quant_method=_quant_method(quant_config, f"{prefix}.down_proj"))

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.gelu_tanh:
            if use_fused_kernels(gate_up):
                from kvserve.ops.fused_kernels import gelu_tanh_and_mul

                return self.down_proj(gelu_tanh_and_mul(gate_up))
            gate, up = gate_up.split(self.intermediate, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        if use_fused_kernels(gate_up):
            from kvserve.model.quantization.fp8 import fused_input_quant
            from kvserve.ops import fused_kernels

            quantize, static_scale = fused_input_quant(self.down_proj, gate_up.shape[0])
            if quantize:  # an FP8 down_proj: SiLU*mul quantizes its output for it
                return self.down_proj(fused_kernels.silu_and_mul_fp8(gate_up, static_scale))
            return self.down_proj(fused_kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: one [T, intermediate] buffer fewer


class DecoderLayer(nn.Module):
    # True when the previous layer hands over this layer's normed input (and the residual stream entering it).
    input_is_normed = False

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, quant_config=None,
                 prefix: str = "", layer_idx: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, rotary, backend, quant_config, f"{prefix}.self_attn", layer_idx)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(cfg, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = MLP(cfg, quant_config, f"{prefix}.mlp")
        # The linear that reads the post-attention norm's output: none for a MoE block (router, experts and a
        # shared expert all read it).
        self.mlp_input_linear = getattr(self.mlp, "gate_up_proj", None)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        # Each norm is told which linear reads its output (an FP8 one takes it quantized in the same kernel).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, consumer=self.self_attn.qkv_proj)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, consumer=self.self_attn.qkv_proj)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, consumer=self.mlp_input_linear)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (our parameter, shard id) for projections we merge into one GEMM.
    _MERGED = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
    decoder_layer_cls: type = DecoderLayer
    norm_cls: type = RMSNorm

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 layer_range: tuple[int, int] | None = None, quant_config=None):
        """layer_range: the decoder layers this pipeline stage runs (default: all)."""
        super().__init__()
        self.config = cfg
        ps = get_parallel_state()
        self.is_first_stage, self.is_last_stage = ps.is_first_stage, ps.is_last_stage
        self.start_layer, self.end_layer = layer_range or (0, cfg.num_hidden_layers)
        rotary = self._rotary(cfg, max_positions)
        # Gemma 3: windowed layers turn with their own base and no scaling.
        rotary_local = rotary
        if cfg.rope_local_theta is not None:
            rotary_local = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta, None, cfg.rotary_dim)
        windows = cfg.layer_windows or [None] * cfg.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.is_first_stage else None
        # Layers of other stages are empty placeholders, so parameter names stay the checkpoint's.
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(cfg, rotary if windows[i] is None else rotary_local, backend, quant_config,
                                   f"layers.{i}", i)
            if self.start_layer <= i < self.end_layer else nn.Module()
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = self.lm_head = None
        if self.is_last_stage:
            self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
                self.lm_head.weight = self.embed_tokens.weight  # tied: one tensor
            else:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        # Shared by all layers; registered once here so .to(device) moves it once.
        self.rotary = rotary
        self.rotary_local = rotary_local if rotary_local is not rotary else None
        # EAGLE-3: the layers whose input residual stream (hidden + residual) forward also returns.
        self.aux_layer_ids: tuple[int, ...] = ()

    @staticmethod
    def _rotary(cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[self.start_layer].self_attn.num_kv_heads

    @property
    def attention_head_dim(self) -> int:
        return self.layers[self.start_layer].self_attn.head_dim

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Returns the final hidden states on the last stage, (hidden, residual) for the next stage on the others.
        With `aux_layer_ids` set (an EAGLE-3 head drafts): (final hidden states, [the residual stream entering
        each of those layers])."""
        if self.is_first_stage:
            hidden, residual = self.embed(input_ids), None
        else:
            hidden, residual = intermediate
        aux = []
        for i, (layer, kv_cache) in enumerate(zip(self.layers[self.start_layer:self.end_layer], kv_caches),
                                              start=self.start_layer):
            if i in self.aux_layer_ids:
                # layer ids >= 1, so a residual exists
                aux.append(residual if layer.input_is_normed else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if not self.is_last_stage:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return (hidden, aux) if self.aux_layer_ids else hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        if self.config.logit_scale != 1.0:  # Cohere
            logits = logits * self.config.logit_scale
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _on_this_rank(self, name: str) -> bool:
        """Whether a checkpoint tensor (our name) belongs to this pipeline stage."""
        if name.startswith("layers."):
            return self.start_layer <= int(name.split(".", 2)[1]) < self.end_layer
        if name.startswith("embed_tokens."):
            return self.embed_tokens is not None
        return self.is_last_stage  # norm, lm_head

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Load HF-named tensors (or lazy slices, read only for this rank's part); returns the names of our
        parameters that were filled (a merged parameter only once every part was)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        parts_loaded: dict[str, set] = {}  # merged parameter -> the shard ids filled so far
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if self._load_kv_scale(name, tensor):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            targets = [name]
            if name == "embed_tokens.weight" and self.config.tie_word_embeddings and self.is_last_stage \
                    and self.lm_head.weight is not getattr(self.embed_tokens, "weight", None):
                targets = ["lm_head.weight"] + ([name] if self.embed_tokens is not None else [])
            elif not self._on_this_rank(name):
                continue
            for target in targets:
                loaded.add(self._load_one(params, target, tensor))
                merged, shard = self._merged_name(target)
                if shard is not None and merged in params:
                    parts_loaded.setdefault(merged, set()).add(shard)
        for merged, got in parts_loaded.items():
            absent = [f"model.{merged.replace(our, hf)}" for hf, (our, shard) in self._MERGED.items()
                      if our in merged and shard not in got]
            if absent:  # the fused GEMM would run on uninitialized rows
                raise ValueError(f"the checkpoint lacks {', '.join(absent)}, which kvserve fuses with the other "
                                 f"parts of {merged}; is the checkpoint complete?")
        return loaded

    def _merged_name(self, name: str) -> tuple[str, object]:
        """(our parameter, shard id) of a checkpoint tensor that is one part of a merged projection, else
        (name, None)."""
        for hf_part, (our_part, shard_id) in self._MERGED.items():
            if hf_part in name:
                return name.replace(hf_part, our_part), shard_id
        return name, None

    def _load_one(self, params: dict, name: str, tensor) -> str:
        name, shard = self._merged_name(name)
        param = params.get(name)
        if param is None and name.endswith(".bias") and not as_tensor(tensor).any():
            return name  # GPTQ tools save all-zero biases for layers that have none
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
        owner = self.get_submodule(name.rsplit(".", 1)[0])
        loader = getattr(param, "weight_loader", None) or owner.weight_loader
        try:
            with torch.no_grad():
                loader(param, tensor, shard)
        except ValueError as exc:  # name the layer, and the expected layout of a quantized tensor
            hint = getattr(param, "format_hint", None)
            raise ValueError(f"{name}: {exc}" + (f"; expected layout {hint}" if hint else "")) from None
        return name

    _KV_SCALE_NAMES = {  # checkpoint suffix -> our buffer (llm-compressor writes the first two forms)
        ".self_attn.k_scale": "k_scale", ".self_attn.v_scale": "v_scale",
        ".self_attn.k_proj.output_scale": "k_scale", ".self_attn.v_proj.output_scale": "v_scale",
        ".self_attn.k_proj.k_scale": "k_scale", ".self_attn.v_proj.v_scale": "v_scale",
    }

    def _load_kv_scale(self, name: str, tensor) -> bool:
        """Per-tensor KV cache scales of FP8-KV checkpoints (the largest, if a checkpoint has several)."""
        for suffix, buffer in self._KV_SCALE_NAMES.items():
            if name.endswith(suffix):
                if self._on_this_rank(name):
                    attn = self.get_submodule(name[: -len(suffix)] + ".self_attn")
                    getattr(attn, buffer).copy_(as_tensor(tensor).float().max().reshape(1))
                return True
        return False


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass

