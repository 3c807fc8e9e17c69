"""Model building blocks. Linear layers are our own classes with a weight loader per parameter, so
quantized or tensor-parallel variants can replace them without touching the model code."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn


# Fused Triton kernels run on CUDA, and on the CPU under Triton's interpreter (how CI tests them).
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_fused_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda or _TRITON_INTERPRET


def as_tensor(loaded) -> torch.Tensor:
    """A checkpoint tensor, read now if it was handed over lazily (a CheckpointSlice)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.load()


_SERVING_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def copy_into(target: torch.Tensor, loaded, what: str) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} does not match parameter {tuple(target.shape)}")
    loaded = as_tensor(loaded)
    # Float weights go to the serving dtype; quantized tensors (packed int32, fp8) must arrive in the dtype
    # their method chose: a cast would destroy them, so a mismatch is a corrupt or mislabelled checkpoint.
    if loaded.dtype != target.dtype and not (loaded.dtype in _SERVING_FLOATS and target.dtype in _SERVING_FLOATS):
        raise ValueError(f"{what}: checkpoint tensor has dtype {loaded.dtype}, but the layer's quantization "
                         f"method expects {target.dtype}; is --quantization right for this checkpoint?")
    target.copy_(loaded)


def _packed(param, dim: int, n: int) -> int:
    """n features along dim, in the parameter's units (packed int4 holds pack_factor features per element)."""
    if getattr(param, "packed_dim", None) == dim:
        return n // param.pack_factor
    return n


class LinearBase(nn.Module):
    """y = x W^T (+ b), weights created and applied by a linear method (unquantized unless one is given).

    Tensor parallel subclasses hold one rank's slice; `weight_loader` is the one place that cuts that slice
    out of a checkpoint tensor (a torch tensor, or a lazy safetensors slice read only for this rank)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None,
                 params_dtype: torch.dtype | None = None, input_size_per_partition: int | None = None,
                 output_partition_sizes: list[int] | None = None):
        super().__init__()
        from kvserve.model.linear_method import UnquantizedLinearMethod

        self.input_size = self.in_features = input_size
        self.output_size = self.out_features = output_size
        self.input_size_per_partition = input_size if input_size_per_partition is None else input_size_per_partition
        self.output_partition_sizes = [output_size] if output_partition_sizes is None else list(output_partition_sizes)
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, self.input_size_per_partition, self.output_partition_sizes,
                                         input_size, output_size, self.params_dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self._bias_size(), dtype=self.params_dtype), requires_grad=False)
            self.bias.output_dim = self._bias_output_dim
        else:
            self.bias = None

    tp_size = 1
    tp_rank = 0
    _bias_output_dim = 0  # row-parallel layers keep a full, replicated bias

    def _bias_size(self) -> int:
        return sum(self.output_partition_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        copy_into(param.data, loaded, "weight")


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split over the TP ranks: rank r holds rows [r * out/tp, (r + 1) * out/tp)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None,
                 params_dtype: torch.dtype | None = None, output_sizes: list[int] | None = None):
        from kvserve.distributed.parallel_state import get_tp_rank, get_tp_size

        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        output_sizes = output_sizes or [output_size]
        for size in output_sizes:
            if size % self.tp_size:
                raise ValueError(f"{type(self).__name__}: output size {size} is not divisible by "
                                 f"--tensor-parallel-size {self.tp_size}")
        super().__init__(input_size, output_size, bias, quant_method, params_dtype,
                         output_partition_sizes=[s // self.tp_size for s in output_sizes])

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is not None:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        copy_into(param.data, loaded, "weight")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input in one GEMM (gate+up); shard_id = index of the part.
    Each rank holds its slice of every part, parts one after another."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, quant_method=None,
                 params_dtype: torch.dtype | None = None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, quant_method, params_dtype, output_sizes=output_sizes)

    def _shard(self, shard_id) -> tuple[int, int, int]:
        """(offset in this rank's param, size, start in the full checkpoint tensor), in output features."""
        sizes = [s // self.tp_size for s in self.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id], self.tp_rank * sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is None:  # a checkpoint that stores the merged tensor already
            return super().weight_loader(param, loaded)
        dim = getattr(param, "output_dim", None)
        if dim is None and getattr(param, "input_dim", None) is not None:  # per input row (GPTQ g_idx): shared
            return self._load_shared_rows(param, loaded, shard_id)
        if dim is None:  # a per-tensor scale of one part: it goes to that part's slot
            target = param.data[shard_id] if param.data.numel() > 1 else param.data
            copy_into(target, as_tensor(loaded).reshape(target.shape), f"shard {shard_id}")
            return
        offset, size, start = (_packed(param, dim, n) for n in self._shard(shard_id))
        loaded = loaded.narrow(dim, start, size)
        copy_into(param.data.narrow(dim, offset, size), loaded, f"shard {shard_id}")


    @staticmethod
    def _load_shared_rows(param: nn.Parameter, loaded, shard_id) -> None:
        """One tensor per input row that every part must carry alike: the parts share one GEMM, so one input
        row order (GPTQ act-order g_idx). Parts quantized with different orders cannot be fused."""
        first = getattr(param, "filled_by_shard", None)
        if first is None:
            copy_into(param.data, loaded, f"shard {shard_id}")
            param.filled_by_shard = shard_id
            return
        loaded = as_tensor(loaded)
        if tuple(loaded.shape) != tuple(param.shape) or not torch.equal(loaded.to(param.dtype), param.data):
            raise ValueError(f"shard {shard_id} differs from shard {first}: kvserve fuses these projections into "
                             f"one GEMM, which needs the same per-row tensor in every part (GPTQ act-order "
                             f"checkpoints whose q/k/v or gate/up parts have different g_idx are not supported; "
                             f"quantize them with one act order, as GPTQ does for layers reading the same input)")


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v in one GEMM, sharded by heads. With more TP ranks than KV heads each KV head is
    replicated on tp / num_kv_heads ranks (each rank holds one)."""

    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 quant_method=None, params_dtype: torch.dtype | None = None):
        from kvserve.distributed.parallel_state import get_tp_size

        tp = get_tp_size()
        if num_heads % tp:
            # EngineConfig checks the layout first, naming the sizes that fit; this guards direct construction.
            raise ValueError(f"The model's {num_heads} attention heads are not divisible by "
                             f"--tensor-parallel-size {tp}.")
        if (num_kv_heads % tp) if tp <= num_kv_heads else (tp % num_kv_heads):
            raise ValueError(f"The model's {num_kv_heads} KV heads and --tensor-parallel-size {tp} do not fit: "
                             f"one must divide the other.")
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.num_kv_head_replicas = max(1, tp // num_kv_heads)
        self.head_dim = head_dim
        # Sizes as if every rank held distinct heads; replication is handled where the checkpoint is cut.
        super().__init__(hidden, [num_heads * head_dim, self.num_kv_heads * tp * head_dim,
                                  self.num_kv_heads * tp * head_dim], bias, quant_method, params_dtype)

    def _shard(self, shard_id) -> tuple[int, int, int]:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        if shard_id == 0:
            return 0, q, self.tp_rank * q
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        return q + (shard_id - 1) * kv, kv, kv_rank * kv

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        super().weight_loader(param, loaded, self._SHARDS.get(shard_id, shard_id))


class RowParallelLinear(LinearBase):
    """Input features split over the TP ranks; the partial products are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None,
                 params_dtype: torch.dtype | None = None, reduce_results: bool = True):
        from kvserve.distributed.parallel_state import get_tp_rank, get_tp_size

        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        if input_size % self.tp_size:
            raise ValueError(f"{type(self).__name__}: input size {input_size} is not divisible by "
                             f"--tensor-parallel-size {self.tp_size}")
        self.reduce_results = reduce_results
        super().__init__(input_size, output_size, bias, quant_method, params_dtype,
                         input_size_per_partition=input_size // self.tp_size)

    _bias_output_dim = None

    def _bias_size(self) -> int:
        return self.output_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kvserve.distributed.parallel_state import tensor_parallel_all_reduce

        out = self.quant_method.apply(self, x, self.bias if self.tp_size == 1 else None)
        if self.tp_size > 1 and self.reduce_results:
            out = tensor_parallel_all_reduce(out)
            if self.bias is not None:
                out = out + self.bias  # after the sum: added once, not tp times
        return out

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is not None:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        copy_into(param.data, loaded, "weight")


# Names the model code used before tensor parallelism.
MergedColumnLinear = MergedColumnParallelLinear
QKVLinear = QKVParallelLinear


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over the TP ranks; each rank looks up the ids in its range, the rest are zeros,
    and an all-reduce assembles the full rows."""

    def __init__(self, vocab_size: int, hidden: int, params_dtype: torch.dtype | None = None):
        super().__init__()
        from kvserve.distributed.parallel_state import get_tp_rank, get_tp_size

        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        if vocab_size % self.tp_size:
            raise ValueError(f"The vocabulary ({vocab_size} tokens) is not divisible by --tensor-parallel-size "
                             f"{self.tp_size}; use a tensor parallel size that divides {vocab_size}.")
        self.vocab_size = vocab_size
        self.shard_size = vocab_size // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden, dtype=params_dtype or torch.get_default_dtype()),
                                   requires_grad=False)
        self.weight.output_dim = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        from kvserve.distributed.parallel_state import tensor_parallel_all_reduce

        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_parallel_all_reduce(out)

    def weight_loader(self, param, loaded, shard_id=None):
        copy_into(param.data, loaded.narrow(0, self.vocab_start, self.shard_size), "embedding")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding (so tied weights shard alike).

    Logits are all-gathered and every TP rank samples, with the same seeds and the same random stream, so
    every rank holds the same sampled ids on its device: with async scheduling the next step's input ids
    are filled from them locally. Gathering to rank 0 instead would move the same logits bytes to one rank
    and then need a broadcast of the sampled ids back to the others, one more collective per step on the
    critical path."""

    packs_for_cpu_gemm = True  # ops/cpu_gemm.py packs its weight for compute_logits on the CPU

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        from kvserve.distributed.parallel_state import tensor_parallel_all_gather

        packed = getattr(self, "packed_weight", None)  # the CPU's oneDNN copy (kvserve.ops.cpu_gemm)
        logits = F.linear(hidden, self.weight) if packed is None else packed.linear(hidden)
        return tensor_parallel_all_gather(logits, dim=-1)


VocabEmbedding = VocabParallelEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, consumer: nn.Module | None = None):
        """With `residual`: returns (norm(x + residual), x + residual), the fused pre-norm pattern. `consumer`:
        the linear layer that reads the output; an FP8 one may get it quantized here (an Fp8Activation)."""
        if use_fused_kernels(x):
            from kvserve.ops import fused_kernels

            if consumer is not None:
                from kvserve.model.quantization.fp8 import fused_input_quant

                quantize, static_scale = fused_input_quant(consumer, x.numel() // x.shape[-1])
                if quantize:
                    return fused_kernels.rms_norm_fp8(x, self.weight, self.eps, residual, static_scale)
            return fused_kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)

    def weight_loader(self, param, loaded, shard_id=None):
        copy_into(param.data, loaded, "weight")

    def kernel_weight(self) -> torch.Tensor:
        """What the fused kernels multiply the normed row by."""
        return self.weight


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in fp32 and rounded once at the end (HF's order; the
    checkpoint stores weight, not 1 + weight). Same residual contract as RMSNorm."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if use_fused_kernels(x):  # the fused kernel with weight 1 + w (fp32; normed x rounded first there)
            from kvserve.ops.fused_kernels import rms_norm

            return rms_norm(x, self.kernel_weight(), self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)

    def kernel_weight(self) -> torch.Tensor:
        # Computed once per loaded weight (its version counts in-place loads), before any graph capture:
        # the engine's profile run calls every layer first.
        key = (self.weight._version, self.weight.device)
        if getattr(self, "_offset_key", None) != key:
            self._offset = 1.0 + self.weight.float()
            self._offset_key = key
        return self._offset

    def then_add_norm(self, following: "GemmaRMSNorm", x: torch.Tensor, residual: torch.Tensor):
        """following(self(x), residual): a sublayer's output norm, the residual add and the next sublayer's
        input norm, as (normed input, new residual); one kernel on the fused path, the same bits as two."""
        if use_fused_kernels(x):
            from kvserve.ops.fused_kernels import norm_add_norm

            return norm_add_norm(x, residual, self.kernel_weight(), self.eps, following.kernel_weight(),
                                 following.eps)
        return following(self(x), residual)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection (OLMo 2), whose features are split over the TP ranks by heads:
    each rank holds `local_dim` features (its heads, shard `shard_index` of the checkpoint's weight) and the
    mean square is summed over ranks. A KV head replicated on r ranks is counted r times over r times as
    many features, so sum / (local_dim * tp) is the mean either way. fp32, weight applied before rounding."""

    def __init__(self, local_dim: int, shard_index: int, eps: float):
        super().__init__()
        from kvserve.distributed.parallel_state import get_tp_size

        self.eps, self.local_dim, self.shard_index = eps, local_dim, shard_index
        self.tp_size = get_tp_size()
        self.weight = nn.Parameter(torch.ones(local_dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sum_sq = xf.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            from kvserve.distributed.parallel_state import tensor_parallel_all_reduce

            sum_sq = tensor_parallel_all_reduce(sum_sq)
        mean_sq = sum_sq / (self.local_dim * self.tp_size)
        return (self.weight.float() * (xf * torch.rsqrt(mean_sq + self.eps))).to(x.dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        copy_into(param.data, loaded.narrow(0, self.shard_index * self.local_dim, self.local_dim), "weight")


def _longrope(inv_freq: torch.Tensor, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-dimension divisors, the long ones when the engine's max_model_len exceeds the
    pre-training length (HF switches per forward as a sequence grows; fixing the choice per engine keeps a
    request's cached keys and its later queries on one rotary), and cos/sin scaled by the attention factor."""
    original = scaling["original_max_position_embeddings"]
    factors = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    factor = scaling.get("factor") or scaling.get("max_position_embeddings", original) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, attention_factor


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(scaling: dict, dim: int, theta: float) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, DeepSeek): frequencies above the correction range kept, below it divided by the factor,
    a linear ramp between; cos/sin scaled by the attention factor (DeepSeek's mscale / mscale_all_dim ratio
    where given). As HF transformers computes it, `truncate` (default on) rounding the range outward."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale()

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)  # rounded as HF rounds it
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half layout (HF's Llama convention), cos/sin cached in fp32.
    With rotary_dim < head_dim (partial rotary, Phi-4-mini) only each head's first rotary_dim dims turn."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.rotary_dim = dim = rotary_dim or head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        attention_factor = 1.0
        if kind == "longrope":
            inv_freq, attention_factor = _longrope(inv_freq, scaling, max_positions)
        elif kind == "yarn":
            inv_freq, attention_factor = _yarn(scaling, dim, theta)
        elif kind not in ("default", "llama3", "linear"):
            raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, "
                             f"longrope, yarn)")
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_cached", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cached", freqs.sin() * attention_factor, persistent=False)
        self._step_positions: torch.Tensor | None = None
        self._step_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                norms: tuple[RMSNorm, RMSNorm] | None = None):
        """q: [T, H, D], k: [T, Hkv, D]; returns both rotated (in place on the fused path). `norms`: per-head
        (q_norm, k_norm) applied first; on the fused path with every dim turning, inside the rotary kernel."""
        rot = self.rotary_dim
        if norms is not None:
            q_norm, k_norm = norms
            if use_fused_kernels(q) and rot == q.shape[-1] and rot % 2 == 0 and q_norm.eps == k_norm.eps:
                from kvserve.ops.fused_kernels import apply_rotary_

                return apply_rotary_(positions, q, k, self.cos_cached, self.sin_cached,
                                     (q_norm.kernel_weight(), k_norm.kernel_weight()), q_norm.eps)
            q, k = q_norm(q), k_norm(k)
        if rot < q.shape[-1]:  # partial: the first rot dims turn, the rest pass through
            if use_fused_kernels(q):
                self._rotate_all(positions, q[..., :rot], k[..., :rot])  # in place, through the views
                return q, k
            q_rot, k_rot = self._rotate_all(positions, q[..., :rot], k[..., :rot])
            return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)
        return self._rotate_all(positions, q, k)

    def _rotate_all(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if use_fused_kernels(q) and q.shape[-1] % 2 == 0:
            from kvserve.ops.fused_kernels import apply_rotary_

            return apply_rotary_(positions, q, k, self.cos_cached, self.sin_cached)
        # Every layer of a step gets the same positions tensor: look cos/sin up once per step.
        if self._step_positions is not positions:
            cos = self.cos_cached[positions].unsqueeze(1)
            sin = self.sin_cached[positions].unsqueeze(1)
            self._step_cos_sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            self._step_positions = positions
        cos, sin = self._step_cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin (cos/sin cast to x's dtype), each product and sum rounded as HF
    rounds it, so results are bit-identical in every dtype, without materialising rotate_half(x): the first
    half's (-x2) * sin + x1 * cos is x1 * cos - x2 * sin exactly (negation is exact)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    out[..., :half] -= x2 * sin[..., :half]
    out[..., half:] += x1 * sin[..., half:]
    return out
