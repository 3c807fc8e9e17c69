"""Read GGUF checkpoints as an HF-style config dict and float32 weights under HF names.

Supports the llama.cpp architectures "llama" (also used for Mistral and SmolLM GGUFs, and for Mixtral with
expert_count set), "qwen2", "qwen3", "qwen2moe", "qwen3moe" and "olmo2". A MoE layer's stacked expert tensors
(ffn_*_exps, [E, out, in]) are yielded per expert under HF's names; the MoE block is named `mlp` (as in Qwen's
checkpoints; kvserve's Mixtral reads both). Weights are dequantised with gguf-py exactly as transformers does,
so the tensors are bit-identical to ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

GGUFSource = Union[str, os.PathLike, GGUFReader]


@dataclass(frozen=True)
class _ArchSpec:
    hf_class: str
    model_type: str
    # llama.cpp's converter interleaves Q/K rows for llama-family rope; we must undo it.
    permute_qk: bool
    # Layer tensors named otherwise than in the llama layout (_LAYER_TENSORS), GGUF name -> HF module.
    layer_tensors: tuple[tuple[str, str], ...] = ()


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
}
# llama.cpp's MoE graphs: whether the top-k routing weights are renormalised (its norm_w), per architecture.
_MOE_RENORMALISE = {"llama": True, "qwen2moe": False, "qwen3moe": True}

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

_MISSING = object()


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


def _head_dim(reader: GGUFReader, arch: str, hidden_size: int, num_heads: int) -> int:
    # key_length is explicit (Qwen3); llama GGUFs only record the rope dim, which is head_dim there.
    for key in ("attention.key_length", "rope.dimension_count"):
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
        "head_dim": _head_dim(reader, arch, hidden_size, num_heads),
        "rms_norm_eps": float(arch_key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        # transformers >= 5 reads rope settings from here; older versions from rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(arch_key("context_length")),
        "vocab_size": _vocab_size(reader, arch),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": "float32",
    }
    experts = int(arch_key("expert_count", 0) or 0)
    if experts:
        config.update(_moe_config(arch, arch_key, experts, config["intermediate_size"]))
    for name in ("bos", "eos"):
        token_id = _metadata(reader, f"tokenizer.ggml.{name}_token_id", None)
        if token_id is not None:
            config[f"{name}_token_id"] = int(token_id)
    return config


def _moe_config(arch: str, arch_key, experts: int, intermediate_size: int) -> dict:
    """The HF MoE config fields of a GGUF (llama.cpp's MoE architectures make every layer sparse)."""
    moe = {"num_experts": experts, "num_experts_per_tok": int(arch_key("expert_used_count")),
           "norm_topk_prob": _MOE_RENORMALISE[arch],
           "moe_intermediate_size": int(arch_key("expert_feed_forward_length", intermediate_size)),
           "decoder_sparse_step": 1, "mlp_only_layers": []}
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
    for tensor in reader.tensors:
        stem = tensor.name.rsplit(".", 1)[0]
        if stem.split(".")[-1] in _EXPERT_TENSORS:
            yield from _per_expert(stem, _dequantize_tensor(tensor))
            continue
        try:
            hf_name = gguf_to_hf_name(tensor.name, spec)
        except ValueError as e:
            raise ValueError(f"{_file_name(reader)}: {e}") from None
        weights = _dequantize_tensor(tensor)
        if hf_name.endswith("shared_expert_gate.weight") and weights.ndim == 1:
            weights = weights[None, :]  # llama.cpp stores the [1, hidden] gate as a vector
        if config is not None and ".attn_q." in tensor.name:
            weights = _unpermute_qk(weights, config["num_attention_heads"])
        elif config is not None and ".attn_k." in tensor.name:
            weights = _unpermute_qk(weights, config["num_key_value_heads"])
        yield hf_name, torch.from_numpy(np.ascontiguousarray(weights))


def _per_expert(stem: str, stacked: np.ndarray) -> Iterator[tuple[str, torch.Tensor]]:
    """blk.N.ffn_gate_exps [E, out, in] -> model.layers.N.mlp.experts.e.gate_proj.weight for each expert e."""
    _, layer, kind = stem.split(".")
    proj = _EXPERT_TENSORS[kind]
    for e in range(stacked.shape[0]):
        yield (f"model.layers.{int(layer)}.mlp.experts.{e}.{proj}.weight",
               torch.from_numpy(np.ascontiguousarray(stacked[e])))
