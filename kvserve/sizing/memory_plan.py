"""GPU memory arithmetic shared by the engine's start-up sizing and `kvserve plan`. No torch here.

The engine calls the same functions with what it measured (weights after loading, the profiled
activation peak); `kvserve plan` calls them with estimates from the model's shape. Everything is per
rank: attention heads, MLP columns and the vocabulary split over tensor-parallel ranks, layers over
pipeline stages; KV heads are replicated when there are more tensor-parallel ranks than KV heads.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvserve.core.kv_cache_groups import longest_request_tokens, num_kv_slots, request_blocks
from kvserve.units import GiB, MiB, cdiv  # noqa: F401 - re-exported: plan and memory read them from here

DEFAULT_CPU_KV_CACHE_BYTES = 2 * GiB
# What a CUDA context and the libraries outside torch's allocator take on a GPU before the engine loads
# anything; a plan counts it as "held by others" (the engine measures it).
CUDA_CONTEXT_BYTES = 512 * MiB
GRAPH_POOL_MARGIN_BYTES = 64 * MiB

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# --kv-cache-dtype values the engine implements (fp8 is stored as e4m3), checked by EngineArgs and here.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = ("fp8", "awq", "gptq")
INT4_GROUP_SIZE = 128
MXFP4_GROUP = 32  # inputs per E8M0 scale of an MXFP4 weight (gpt-oss's experts: kvserve/ops/mxfp4.py)


def mxfp4_experts_packed(hidden: int, intermediate_per_rank: int) -> bool:
    """Whether a rank serves MXFP4 experts packed (4.25 bits a weight) rather than dequantized: both of its
    GEMMs' inputs (the hidden size; its share of the intermediate size) must be whole groups of MXFP4_GROUP."""
    return hidden % MXFP4_GROUP == 0 and intermediate_per_rank % MXFP4_GROUP == 0


BLOCK_FP8_SCALE_SUFFIX = "_scale_inv"


def block_fp8_weights(names) -> set[str]:
    """The block-wise FP8 weights among a checkpoint's tensor names: those stored with a `_scale_inv` beside
    them."""
    return {n.removesuffix(BLOCK_FP8_SCALE_SUFFIX) for n in names if n.endswith(BLOCK_FP8_SCALE_SUFFIX)}


def block_fp8_dequantized_at_load(name: str) -> bool:
    """Whether a block-wise FP8 weight (or a layer's prefix) is dequantized to the serving dtype as it is read:
    the routed experts (no block-scaled grouped GEMM yet). The rest is served as stored (quantization/fp8_block.py)."""
    return "experts" in name.split(".")


def weights_format(quant_config) -> dict:
    """PlanInputs' quantization fields for the engine's resolved quantization (a QuantizationConfig, or None):
    quantization in the terms weight_bytes counts ("fp8": one byte a weight, as fp8, compressed-tensors and
    8-bit GPTQ store it, and block-wise FP8's dense layers; "awq" / "gptq": int4 with group scales; None: the
    serving dtype), whether the weights are quantized at load (then the checkpoint's bytes are not what the GPU
    holds), and the routed experts' own format where it differs (experts_quantization: "mxfp4", gpt-oss's
    experts, the rest of its layers in the serving dtype; "dequantized", block-wise FP8's experts)."""
    experts = getattr(quant_config, "experts_format", None)
    if experts is not None:  # the experts' own format: gpt-oss's mxfp4 (dense layers unquantized), or block-wise
        # FP8's dequantized experts (dense layers in fp8)
        dense = "fp8" if quant_config.bits_per_weight < 16 else None
        return {"quantization": dense, "quantized_at_load": False, "experts_quantization": experts}
    if quant_config is None or quant_config.bits_per_weight >= 16:
        return dict(quantization=None, quantized_at_load=False)
    name = quant_config.name if getattr(quant_config, "bits", 8) == 4 else "fp8"
    return dict(quantization=name, quantized_at_load=getattr(quant_config, "checkpoint_is_fp8", True) is False)


def kv_cache_dtype_bytes(kv_cache_dtype: str | None, model_dtype: str) -> int:
    """'auto' stores K/V in the model's dtype; 'fp8' in one byte."""
    if kv_cache_dtype in (None, "auto"):
        return DTYPE_BYTES[model_dtype]
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return 1
    raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}.")


# ---- the model's shape on one rank -----------------------------------------------------------------
@dataclass(frozen=True)
class RankShape:
    """One tensor-parallel rank of one pipeline stage."""

    stage: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int  # this rank's slice of the vocabulary (embedding rows / lm_head columns)
    has_embedding: bool
    has_lm_head: bool  # also the final norm
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    # Mixture of experts: this stage's sparse layers (the others keep the dense MLP) and one rank's share of them.
    moe_layers: int = 0
    num_experts: int = 0  # the router's width (replicated)
    num_local_experts: int = 0  # all of them split by features, or num_experts / tp whole with expert parallelism
    moe_intermediate_size: int = 0  # per rank, of each local expert
    shared_expert_intermediate_size: int = 0  # per rank
    num_experts_per_tok: int = 0
    # KV tensors of the stage (core/kv_cache_groups.py): one per layer, or per layer of a KV cache group
    # when windowed and full layers interleave (0: one per layer).
    kv_slots: int = 0
    # gpt-oss: biased router and experts, an o_proj bias and a float32 sink logit per head.
    moe_bias: bool = False
    shared_expert_gated: bool = True
    o_proj_bias: bool = False
    attention_sinks: bool = False
    # What one KV head costs per token in each of the cache's K and V planes (ModelConfig.kv_cache_head_dim;
    # head_dim unless the model caches something else: DeepSeek's latent, one "head" for all of them).
    kv_head_dim: int = 0
    # DeepSeek's latent attention: (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim),
    # or None for q/k/v heads.
    mla: tuple[int, int, int, int, int] | None = None


def pipeline_layers(num_layers: int, pp: int) -> list[int]:
    """Layers per stage: an even split, the first `num_layers % pp` stages one more."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def _moe_shape(cfg, tp: int, expert_parallel: bool, first_layer: int, num_layers: int) -> dict:
    """RankShape's MoE fields for the stage holding layers [first_layer, first_layer + num_layers), as
    kvserve/model/moe.py places experts (the largest rank's share with expert parallelism)."""
    experts = getattr(cfg, "num_experts", 0)
    if not experts:
        return {}
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(first_layer, first_layer + num_layers))
    if expert_parallel and tp > 1:
        local, inter = cdiv(experts, tp), cfg.moe_intermediate_size
    else:
        if cfg.moe_intermediate_size % tp:
            raise ValueError(f"--tensor-parallel-size {tp} does not divide the experts' intermediate size "
                             f"{cfg.moe_intermediate_size}; use --enable-expert-parallel or a size that divides it.")
        local, inter = experts, cfg.moe_intermediate_size // tp
    return dict(moe_layers=moe_layers, num_experts=experts, num_local_experts=local, moe_intermediate_size=inter,
                shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp,
                num_experts_per_tok=cfg.num_experts_per_tok, moe_bias=getattr(cfg, "moe_bias", False),
                shared_expert_gated=getattr(cfg, "shared_expert_gated", True))


def rank_shapes(cfg, tp: int = 1, pp: int = 1, expert_parallel: bool = False) -> list[RankShape]:
    """One RankShape per pipeline stage (every tensor-parallel rank of a stage is the same size)."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-parallel-size and --pipeline-parallel-size must be >= 1, got {tp} and {pp}.")
    if heads % tp:
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {heads} attention heads.")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"--tensor-parallel-size {tp} neither divides nor is a multiple of the model's "
                         f"{kv_heads} KV heads.")
    if cfg.intermediate_size % tp:
        raise ValueError(f"--tensor-parallel-size {tp} does not divide intermediate_size {cfg.intermediate_size}.")
    if pp > cfg.num_hidden_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} exceeds the model's {cfg.num_hidden_layers} layers.")
    return [
        RankShape(
            stage=i,
            num_layers=n,
            num_heads=heads // tp,
            num_kv_heads=1 if getattr(cfg, "uses_mla", False) else max(1, kv_heads // tp),  # replicated: tp > kv_heads
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size // tp,
            vocab_size=cdiv(cfg.vocab_size, tp),
            has_embedding=i == 0,
            has_lm_head=i == pp - 1,
            tie_word_embeddings=cfg.tie_word_embeddings,
            attention_bias=cfg.attention_bias,
            qk_norm=cfg.qk_norm,
            o_proj_bias=getattr(cfg, "o_proj_bias", False),
            attention_sinks=getattr(cfg, "attention_sinks", False),
            kv_head_dim=getattr(cfg, "kv_cache_head_dim", cfg.head_dim),
            mla=(cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
            if getattr(cfg, "uses_mla", False) else None,
            **_moe_shape(cfg, tp, expert_parallel, first, n),
            kv_slots=num_kv_slots(_layer_windows(cfg), range(first, first + n)),
        )
        for i, (first, n) in enumerate(_stage_layers(cfg.num_hidden_layers, pp))
    ]


def _layer_windows(cfg) -> list[int | None]:
    return list(getattr(cfg, "layer_windows", None) or [None] * cfg.num_hidden_layers)


def draft_rank_shape(draft_cfg, tp: int = 1) -> RankShape:
    """A draft model (speculative decoding) on one rank: split like the target, every layer on the one
    stage (drafts run with a single pipeline stage). Its KV cache lives in the target's blocks: each block
    holds the target's and the draft's K/V of the same tokens."""
    return rank_shapes(draft_cfg, tp, 1)[0]


def draft_bytes(draft_cfg, tp: int, dtype_bytes: int, kv_dtype_bytes: int, max_model_len: int) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) a draft model adds to each rank; (0, 0) without one."""
    if draft_cfg is None:
        return 0, 0
    shape = draft_rank_shape(draft_cfg, tp)
    weights = weight_bytes(shape, dtype_bytes) + rotary_cache_bytes(shape.head_dim, max_model_len)
    return weights, kv_bytes_per_token(shape, kv_dtype_bytes)


def _stage_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """(first layer, number of layers) of each stage."""
    counts = pipeline_layers(num_layers, pp)
    return [(sum(counts[:i]), n) for i, n in enumerate(counts)]


def _linear_bytes(in_features: int, out_features: int, dtype_bytes: int, quantization: str | None) -> int:
    if quantization == "fp8":
        return in_features * out_features + 4  # one fp32 scale per tensor
    if quantization in ("awq", "gptq"):
        # int4 weights, and per group of INT4_GROUP_SIZE input rows an fp16 scale and an int4 zero per column
        groups = cdiv(in_features, INT4_GROUP_SIZE)
        return in_features * out_features // 2 + groups * out_features * 2 + groups * out_features // 2
    if quantization == "mxfp4":  # two E2M1 values a byte and a one-byte scale per MXFP4_GROUP inputs
        return in_features * out_features // 2 + in_features // MXFP4_GROUP * out_features
    return in_features * out_features * dtype_bytes


def _mlp_bytes(hidden: int, intermediate: int, dtype_bytes: int, quantization: str | None) -> int:
    """gate_up and down of one MLP (or one expert)."""
    return (_linear_bytes(hidden, 2 * intermediate, dtype_bytes, quantization)
            + _linear_bytes(intermediate, hidden, dtype_bytes, quantization))


def weight_bytes(shape: RankShape, dtype_bytes: int, quantization: str | None = None,
                 experts_quantization: str | None = None) -> int:
    """Parameters of one rank in memory. Quantization applies to the decoder's linear layers; embeddings,
    lm_head and norms stay in the model dtype (as in vLLM). experts_quantization: the routed experts' own
    format where it differs (gpt-oss's "mxfp4", weights_format)."""
    h, hd = shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd
    attention = (
        _linear_bytes(h, q + 2 * kv, dtype_bytes, quantization)
        + _linear_bytes(q, h, dtype_bytes, quantization)
        + 2 * h * dtype_bytes  # input and post-attention norms
        + ((q + 2 * kv) * dtype_bytes if shape.attention_bias else 0)
        + (2 * hd * dtype_bytes if shape.qk_norm else 0)
        + (h * dtype_bytes if shape.o_proj_bias else 0)
        + (shape.num_heads * 4 if shape.attention_sinks else 0)
    )
    if shape.mla is not None:
        attention = _mla_attention_bytes(shape, dtype_bytes, quantization)
    total = shape.num_layers * attention + (shape.num_layers - shape.moe_layers) * _mlp_bytes(
        h, shape.intermediate_size, dtype_bytes, quantization)
    if shape.moe_layers:
        experts = experts_quantization or quantization
        packed = experts != "mxfp4" or mxfp4_experts_packed(h, shape.moe_intermediate_size)
        if experts == "dequantized" or not packed:
            experts = None  # served dequantized
        moe = shape.num_local_experts * _mlp_bytes(h, shape.moe_intermediate_size, dtype_bytes, experts)
        moe += h * shape.num_experts * dtype_bytes  # the router, unquantized
        if shape.mla is not None:  # DeepSeek: its router and correction bias are fp32
            moe += shape.num_experts * (h + 1) * 4 - h * shape.num_experts * dtype_bytes
        if shape.moe_bias:  # the router's, and each local expert's gate_up and down biases
            moe += (shape.num_experts + shape.num_local_experts * (2 * shape.moe_intermediate_size + h)) * dtype_bytes
        if shape.shared_expert_intermediate_size:
            moe += _mlp_bytes(h, shape.shared_expert_intermediate_size, dtype_bytes, quantization)
            moe += h * dtype_bytes if shape.shared_expert_gated else 0
        total += shape.moe_layers * moe
    vocab_rows = shape.vocab_size * h * dtype_bytes
    if shape.has_embedding:
        total += vocab_rows
    if shape.has_lm_head:
        total += h * dtype_bytes  # final norm
        # Tied embeddings share one tensor when embedding and head live on the same stage.
        if not (shape.tie_word_embeddings and shape.has_embedding):
            total += vocab_rows
    return total


def _mla_attention_bytes(shape: RankShape, dtype_bytes: int, quantization: str | None) -> int:
    """One rank's latent attention: q_a (replicated) and q_b (its heads), kv_a (replicated) and kv_b (its
    heads), o_proj, the latent norms and the layer's two norms."""
    h, heads = shape.hidden_size, shape.num_heads
    q_rank, kv_rank, nope, rope, v = shape.mla
    q = (_linear_bytes(h, q_rank, dtype_bytes, quantization) + q_rank * dtype_bytes
         + _linear_bytes(q_rank, heads * (nope + rope), dtype_bytes, quantization)) if q_rank else \
        _linear_bytes(h, heads * (nope + rope), dtype_bytes, quantization)
    kv = (_linear_bytes(h, kv_rank + rope, dtype_bytes, quantization) + kv_rank * dtype_bytes
          + _linear_bytes(kv_rank, heads * (nope + v), dtype_bytes, quantization))
    return q + kv + _linear_bytes(heads * v, h, dtype_bytes, quantization) + 2 * h * dtype_bytes


def rotary_cache_bytes(head_dim: int, max_positions: int) -> int:
    """cos and sin tables, fp32, (max_positions, head_dim / 2) each."""
    return 2 * max_positions * (head_dim // 2) * 4


def kv_bytes_per_token(shape: RankShape, kv_dtype_bytes: int) -> int:
    """Bytes of one token position of one block, in every KV cache group alike: a block of a group holds
    that group's layers, `kv_slots` of them on this stage (all the stage's layers for a model whose
    layers attend alike)."""
    return (shape.kv_slots or shape.num_layers) * 2 * shape.num_kv_heads * (shape.kv_head_dim or shape.head_dim) \
        * kv_dtype_bytes


def kv_bytes_per_block(shape: RankShape, kv_dtype_bytes: int, block_size: int) -> int:
    return kv_bytes_per_token(shape, kv_dtype_bytes) * block_size


# The sampler filters and draws this many logits at a time (kvserve/worker/sampler.py), so that its sort's
# temporaries stay bounded whatever the batch and the vocabulary.
SAMPLER_BLOCK_ELEMENTS = 1 << 24


def sampler_peak_bytes(num_seqs: int, vocab_size: int, dtype_bytes: int) -> int:
    """The sampler's worst case: the logits in the model dtype and in float32, then the float32 logits and raw
    logprobs over the whole batch with one block of rows sorted (values, int64 indices, probabilities, their sum)."""
    logits = num_seqs * vocab_size
    block = min(num_seqs, max(1, SAMPLER_BLOCK_ELEMENTS // vocab_size)) * vocab_size
    return max(logits * (dtype_bytes + 4), logits * 8 + block * 20)


def activation_peak_bytes(shape: RankShape, num_tokens: int, num_seqs: int, dtype_bytes: int) -> int:
    """An estimate of the activations the engine's profile run measures (its scratch KV cache left out, as the
    engine leaves it out): the largest layer's live tensors (residual, normed input, merged gate/up, activated
    MLP input, the attention projections) and the logits with the sampler's sort over the vocabulary."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    h, i = shape.hidden_size, shape.intermediate_size
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    # A MoE layer holds, per (token, expert) pair, its gate_up, activated and down rows.
    moe = shape.num_experts_per_tok * (3 * shape.moe_intermediate_size + h) if shape.moe_layers else 0
    layer = num_tokens * (2 * h + max(3 * i, qkv + shape.num_heads * shape.head_dim + h, moe)) * dtype_bytes
    sampler = sampler_peak_bytes(num_seqs, shape.vocab_size, dtype_bytes) if shape.has_lm_head else 0
    return max(layer, sampler + num_tokens * h * dtype_bytes)


# Token counts of the mixed-step CUDA graphs (prefill chunks included), those up to max_num_batched_tokens.
MIXED_GRAPH_TOKEN_SIZES = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512)


def mixed_graph_sizes(max_num_batched_tokens: int) -> list[int]:
    return [t for t in MIXED_GRAPH_TOKEN_SIZES if t <= max_num_batched_tokens]


def cuda_graph_reserve_bytes(activation_peak: int, max_num_seqs: int, max_num_batched_tokens: int,
                             enforce_eager: bool) -> int:
    """Graphs hold activations for up to max(max_num_seqs, the largest mixed graph) tokens; a margin for
    the pool's slack."""
    if enforce_eager:
        return 0
    graph_tokens = max([max_num_seqs, *mixed_graph_sizes(max_num_batched_tokens)])
    return int(activation_peak * min(1.0, graph_tokens / max_num_batched_tokens) * 1.5) + GRAPH_POOL_MARGIN_BYTES


def gpu_budget_bytes(total: int, gpu_memory_utilization: float) -> int:
    return int(total * gpu_memory_utilization)


def kv_cache_bytes(budget: int, others: int, weights: int, activation_peak: int, non_torch: int,
                   graph_reserve: int) -> int:
    """vLLM's rule: total x gpu_memory_utilization, minus what others held at start, the weights, the
    activation peak of the largest step, memory outside torch's allocator and the graph pool."""
    return budget - others - weights - activation_peak - non_torch - graph_reserve


def cpu_kv_cache_bytes(max_num_seqs: int, max_model_len: int, block_size: int, bytes_per_block: int,
                       group_windows=(None,)) -> int:
    """On CPU there is no device memory to measure: a fixed budget (like vLLM's CPU KV space), capped at
    what max_num_seqs requests of max_model_len tokens could ever use."""
    useful = max_num_seqs * request_kv_blocks(max_model_len, block_size, group_windows) * bytes_per_block
    return min(DEFAULT_CPU_KV_CACHE_BYTES, useful)


def request_kv_blocks(max_model_len: int, block_size: int, group_windows=(None,),
                      max_num_batched_tokens: int | None = None) -> int:
    """The most blocks one request of max_model_len tokens holds at once, over every KV cache group: all
    of its blocks in a full group; in a windowed one (which frees blocks behind its window) the window
    plus one step's chunk plus a partly filled block at each end."""
    chunk = min(max_num_batched_tokens or max_model_len, max_model_len)
    return request_blocks(group_windows, max_model_len, chunk, block_size)


def kv_cache_tokens(num_blocks: int, block_size: int, group_windows=(None,),
                    max_num_batched_tokens: int | None = None) -> int:
    """The context one request can reach in num_blocks blocks (every block's tokens when all layers
    attend alike)."""
    return longest_request_tokens(group_windows, num_blocks, max_num_batched_tokens or 1, block_size)


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int, group_windows=(None,)) -> float:
    """Requests of max_model_len tokens the cache holds at once (decoding: a windowed group holds its window)."""
    return num_blocks / request_kv_blocks(max_model_len, block_size, group_windows, 1)


# ---- checkpoint sizes (exact, from headers only) -----------------------------------------------------
_SAFETENSORS_FLOAT = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


def checkpoint_tensors(model_path: str | Path) -> dict[str, tuple[str, int]] | None:
    """name -> (safetensors dtype, element count) from every *.safetensors header of an HF directory,
    reading only the headers; None when there is no safetensors file (GGUF, or a config-only directory)."""
    path = Path(model_path)
    if not path.is_dir():
        return None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    tensors: dict[str, tuple[str, int]] = {}
    for file in files:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            tensors[name] = (info["dtype"], numel)
    return tensors


def checkpoint_weight_bytes(tensors: dict[str, tuple[str, int]], dtype_bytes: int, tie_word_embeddings: bool
                            ) -> int:
    """Bytes the loaded model holds on one GPU: float tensors are cast to the serving dtype, packed/quantized
    tensors (int, fp8, and MXFP4 experts: gpt-oss's `_blocks` of two values a byte and their `_scales`) keep
    their bytes. A tied model's stored lm_head is not loaded. Block-wise FP8 weights (each with a `_scale_inv`)
    keep their bytes, except the routed experts', dequantized at load to the serving dtype (their scales go)."""
    total = 0
    dequantized = {n for n in block_fp8_weights(tensors) if block_fp8_dequantized_at_load(n)}
    for name, (dtype, numel) in tensors.items():
        if "rotary_emb.inv_freq" in name or (tie_word_embeddings and name.endswith("lm_head.weight")):
            continue
        if name.endswith(BLOCK_FP8_SCALE_SUFFIX) and name.removesuffix(BLOCK_FP8_SCALE_SUFFIX) in dequantized:
            continue
        if name.endswith(BLOCK_FP8_SCALE_SUFFIX):  # served as stored, in float32
            total += numel * 4
        elif dtype in _SAFETENSORS_FLOAT or name in dequantized:
            total += numel * dtype_bytes
        else:
            total += numel * _raw_bytes(dtype)
    return total


def _raw_bytes(safetensors_dtype: str) -> int:
    return {"I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2}.get(safetensors_dtype, 1)


# ---- the plan ---------------------------------------------------------------------------------------
@dataclass
class PlanInputs:
    """The settings that decide memory use; `model_config` is kvserve's ModelConfig (pure Python)."""

    model_config: object
    dtype: str  # float32 | bfloat16 | float16 (resolved)
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int = 256
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    quantization: str | None = None  # how the linear weights are held (weights_format)
    quantized_at_load: bool = False  # by the engine (--quantization fp8 on a float checkpoint), not stored so
    experts_quantization: str | None = None  # the routed experts' format where only they are quantized ("mxfp4")
    enforce_eager: bool = False
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    total_gpu_bytes: int | None = None  # None: the CPU rule (no device to size)
    others_bytes: int = CUDA_CONTEXT_BYTES
    # Exact unsharded weight bytes read from the checkpoint's headers, when there is one.
    checkpoint_weights: int | None = None
    draft_model_config: object = None  # speculative decoding with a draft model: its ModelConfig


@dataclass
class RankPlan:
    stage: int
    layers: int
    weights: int
    activation_peak: int
    graph_reserve: int
    kv_bytes_per_token: int  # the target's and, with a draft model, the draft's
    kv_bytes: int  # what this rank can give the KV cache
    draft_weights: int = 0  # included in weights
    draft_kv_bytes_per_token: int = 0  # included in kv_bytes_per_token


@dataclass
class MemoryPlan:
    inputs: PlanInputs = field(repr=False)
    ranks: list[RankPlan]
    budget: int  # total x utilization, per GPU (0 on CPU)
    kv_bytes_per_block: int  # of the rank that decides the block count
    num_blocks: int  # the same on every rank: the smallest any rank can hold
    weights_source: str  # "checkpoint" | "config"

    @property
    def group_windows(self) -> list[int | None]:
        return self.inputs.model_config.kv_cache_group_windows

    @property
    def kv_tokens(self) -> int:
        """The longest context one request can have in this cache."""
        p = self.inputs
        return kv_cache_tokens(max(self.num_blocks, 0), p.block_size, self.group_windows, p.max_num_batched_tokens)

    @property
    def max_concurrency(self) -> float:
        return max_concurrency(max(self.num_blocks, 0), self.inputs.block_size, self.inputs.max_model_len,
                               self.group_windows)

    @property
    def weights_fit(self) -> bool:
        return all(r.weights <= self.budget - self.inputs.others_bytes for r in self.ranks) or self.budget == 0

    @property
    def length_fits(self) -> bool:
        p = self.inputs
        return self.num_blocks >= request_kv_blocks(p.max_model_len, p.block_size, self.group_windows,
                                                    p.max_num_batched_tokens)

    def to_dict(self) -> dict:
        return {
            "ranks": [asdict(r) for r in self.ranks],
            "budget_bytes": self.budget,
            "others_bytes": self.inputs.others_bytes,
            "kv_bytes_per_block": self.kv_bytes_per_block,
            "kv_cache_groups": [{"window": g.window, "layers": len(g.layers)}
                                for g in self.inputs.model_config.kv_cache_groups],
            "num_blocks": max(self.num_blocks, 0),
            "kv_tokens": self.kv_tokens,
            "max_concurrency": self.max_concurrency,
            "max_model_len": self.inputs.max_model_len,
            "weights_source": self.weights_source,
            "num_params": self.inputs.model_config.num_params(),
            "active_params_per_token": self.inputs.model_config.num_active_params(),
        }


def make_plan(p: PlanInputs) -> MemoryPlan:
    cfg = p.model_config
    dtype_bytes = DTYPE_BYTES[p.dtype]
    kv_dtype = kv_cache_dtype_bytes(p.kv_cache_dtype, p.dtype)
    shapes = rank_shapes(cfg, p.tensor_parallel_size, p.pipeline_parallel_size, p.enable_expert_parallel)
    # One rank holds the checkpoint's tensors as stored, unless the engine quantizes them at load.
    single = p.tensor_parallel_size == 1 and p.pipeline_parallel_size == 1 and not p.quantized_at_load
    budget = gpu_budget_bytes(p.total_gpu_bytes, p.gpu_memory_utilization) if p.total_gpu_bytes else 0
    draft_weights, draft_per_token = draft_bytes(p.draft_model_config, p.tensor_parallel_size, dtype_bytes,
                                                 kv_dtype, p.max_model_len)
    ranks = []
    for shape in shapes:
        if single and p.checkpoint_weights is not None:
            weights = p.checkpoint_weights
        else:
            weights = weight_bytes(shape, dtype_bytes, p.quantization, p.experts_quantization)
        # Gemma 3's windowed layers turn with a second table of their own.
        rotary_tables = 2 if getattr(cfg, "rope_local_theta", None) is not None else 1
        weights += rotary_tables * rotary_cache_bytes(shape.mla[3] if shape.mla else shape.head_dim, p.max_model_len)
        weights += draft_weights
        per_token = kv_bytes_per_token(shape, kv_dtype) + draft_per_token
        per_block = per_token * p.block_size
        activation = activation_peak_bytes(shape, p.max_num_batched_tokens, p.max_num_seqs, dtype_bytes)
        graphs = cuda_graph_reserve_bytes(activation, p.max_num_seqs, p.max_num_batched_tokens, p.enforce_eager)
        if p.num_gpu_blocks_override is not None:
            kv = p.num_gpu_blocks_override * per_block
        elif p.kv_cache_memory_bytes is not None:
            kv = p.kv_cache_memory_bytes
        elif p.total_gpu_bytes is None:
            kv = cpu_kv_cache_bytes(p.max_num_seqs, p.max_model_len, p.block_size, per_block,
                                    cfg.kv_cache_group_windows)
        else:
            kv = kv_cache_bytes(budget, p.others_bytes, weights, activation, 0, graphs)
        ranks.append(RankPlan(shape.stage, shape.num_layers, weights, activation,
                              graphs if p.total_gpu_bytes else 0, per_token, kv, draft_weights, draft_per_token))
    # Every stage keeps the same block count: the one with the fewest blocks decides.
    deciding = min(ranks, key=lambda r: r.kv_bytes // (r.kv_bytes_per_token * p.block_size))
    per_block = deciding.kv_bytes_per_token * p.block_size
    num_blocks = p.num_gpu_blocks_override or (deciding.kv_bytes // per_block if deciding.kv_bytes > 0 else 0)
    source = "checkpoint" if single and p.checkpoint_weights is not None else "config"
    return MemoryPlan(p, ranks, budget, per_block, num_blocks, source)


# ---- advice in the tuning order ----------------------------------------------------------------------
@dataclass
class Verdict:
    step: str  # "fits" | "weights" | "length" | "activations"
    flag: str | None  # the one flag to change
    value: object  # its value
    message: str
    notes: list[str] = field(default_factory=list)

    @property
    def suggestion(self) -> str:
        return f"{self.flag} {self.value}" if self.flag else ""


def largest_max_model_len(plan: MemoryPlan) -> int:
    """The longest context whose one request fits the KV cache (a whole number of blocks)."""
    return plan.kv_tokens


def _fits(p: PlanInputs) -> bool:
    try:
        plan = make_plan(p)
    except ValueError:
        return False
    return plan.weights_fit and plan.length_fits


def advise(p: PlanInputs) -> Verdict:
    """Tuning order: fit the weights (tensor parallelism, then FP8, then pipeline stages), then the length
    (--max-model-len), then KV headroom (--gpu-memory-utilization), then the batch (--max-num-seqs)."""
    plan = make_plan(p)
    gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    if p.total_gpu_bytes is None:
        return Verdict("fits" if plan.length_fits else "length", None if plan.length_fits else "--max-model-len",
                       None if plan.length_fits else largest_max_model_len(plan),
                       f"CPU: {plan.kv_tokens} KV tokens, {plan.max_concurrency:.2f}x max_model_len.")
    avail = plan.budget - p.others_bytes
    worst = max(plan.ranks, key=lambda r: r.weights)
    if not plan.weights_fit:
        what = (f"Weights need {gib(worst.weights)} per GPU but only {gib(avail)} is available "
                f"({gib(p.total_gpu_bytes)} x {p.gpu_memory_utilization} - {gib(p.others_bytes)} held by others).")
        for tp in (2, 4, 8):
            if tp > p.tensor_parallel_size and _fits(replace(p, tensor_parallel_size=tp)):
                return Verdict("weights", "--tensor-parallel-size", tp, what + f" With {tp} GPUs it fits.")
        if not p.quantization and _fits(replace(p, quantization="fp8", quantized_at_load=True)):
            return Verdict("weights", "--quantization", "fp8", what + " With FP8 weights it fits.")
        for pp in (2, 3, 4, 6, 8):
            if pp > p.pipeline_parallel_size and _fits(replace(p, pipeline_parallel_size=pp)):
                return Verdict("weights", "--pipeline-parallel-size", pp,
                               what + f" With {pp} pipeline stages of {p.tensor_parallel_size} GPUs it fits.")
        return Verdict("weights", "--quantization", "awq", what + " Nothing up to tp 8 x pp 8 in FP8 fits: "
                       "use a 4-bit (AWQ/GPTQ) checkpoint or a smaller model.")
    if plan.num_blocks <= 0:
        act = max(r.activation_peak + r.graph_reserve for r in plan.ranks)
        msg = (f"No memory is left for the KV cache: weights {gib(worst.weights)} + activations and CUDA graphs "
               f"{gib(act)} use the {gib(avail)} available.")
        for tokens in (4096, 2048, 1024, 512):
            if tokens < p.max_num_batched_tokens and tokens >= p.max_num_seqs and _fits(
                    replace(p, max_num_batched_tokens=tokens)):
                return Verdict("activations", "--max-num-batched-tokens", tokens, msg)
        for tp in (2, 4, 8):
            if tp > p.tensor_parallel_size and _fits(replace(p, tensor_parallel_size=tp)):
                return Verdict("weights", "--tensor-parallel-size", tp, msg + f" With {tp} GPUs it fits.")
        return Verdict("weights", "--quantization", "fp8", msg)
    if not plan.length_fits:
        longest = largest_max_model_len(plan)
        msg = (f"One request of max_model_len {p.max_model_len} needs {p.max_model_len} KV tokens, but the "
               f"KV cache holds {plan.kv_tokens}.")
        for tp in (2, 4, 8):
            if tp > p.tensor_parallel_size and _fits(replace(p, tensor_parallel_size=tp)):
                msg += f" Or keep the length with --tensor-parallel-size {tp}."
                break
        return Verdict("length", "--max-model-len", longest, msg)
    notes = []
    if plan.max_concurrency < 2 and p.gpu_memory_utilization < 0.9 and not p.kv_cache_memory_bytes:
        better = make_plan(replace(p, gpu_memory_utilization=0.9))
        notes.append(f"KV headroom: {plan.max_concurrency:.2f} full-length requests fit; "
                     f"--gpu-memory-utilization 0.9 gives {better.kv_tokens} tokens ({better.max_concurrency:.2f}x).")
    avg_tokens = plan.kv_tokens / p.max_num_seqs
    if avg_tokens < p.max_model_len / 4:
        notes.append(f"Batch: {p.max_num_seqs} running requests share {plan.kv_tokens} KV tokens "
                     f"({avg_tokens:.0f} each); longer requests at full batch preempt. Lower --max-num-seqs if "
                     f"preemptions appear.")
    return Verdict("fits", None, None, f"It fits: {plan.kv_tokens} KV tokens, {plan.max_concurrency:.2f}x "
                   f"max_model_len {p.max_model_len} at once.", notes)
