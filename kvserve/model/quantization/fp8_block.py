"""Block-wise FP8 checkpoints (`quant_method` fp8 with `weight_block_size` [bn, bk]: Qwen's own -FP8 releases,
DeepSeek-V3): each e4m3 weight [N, K] (or stacked [E, N, K]) carries `weight_scale_inv` [ceil(N/bn), ceil(K/bk)],
the factor of each bn x bk block (w = q * scale_inv; the name is the checkpoint format's).

Linear layers keep their e4m3 weights and block scales as stored (Fp8BlockLinearMethod): one byte a weight.
Each output row n reads its scales through a row map (scale row of n), so merged layers (qkv, gate_up) whose
parts end inside a block, and tensor-parallel slices that start inside one, need no repacking. The product:
* decode's few rows (at most W8A16_MAX_ROWS): the W8A16 kernel (kvserve/ops/triton_fp8_gemm.py) with group
  scales, each weight tile dequantized in fp32 and rounded once to the activation dtype;
* more rows: the weight dequantized the same way into a scratch of the activation dtype
  (kvserve/ops/fp8_group_dequant.py), then cuBLAS, which at prefill sizes is compute bound;
* CPU: the torch reference of the same dequantization, then F.linear.
So the product is that of the dequantized weight, as the checkpoint's own dequantization defines it.

Routed experts (memory_plan.block_fp8_dequantized_at_load) have no block-scaled grouped GEMM yet: they are
dequantized to the serving dtype as they are read, at twice the checkpoint's bytes, which `kvserve plan` counts
(memory_plan.checkpoint_weight_bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from kvserve.model.layers import as_tensor, copy_into, use_fused_kernels
from kvserve.model.linear_method import LinearMethodBase
from kvserve.model.quantization.base import QuantizationConfig, checkpoint_names, new_param
from kvserve.sizing.memory_plan import BLOCK_FP8_SCALE_SUFFIX as SCALE_SUFFIX
from kvserve.sizing.memory_plan import block_fp8_dequantized_at_load, block_fp8_weights, checkpoint_tensors

logger = logging.getLogger(__name__)

# Rows up to which the W8A16 kernel streams the weight; above, dequantize + cuBLAS (fp8_matmul.py's w8a16 bound).
W8A16_MAX_ROWS = 16


class Fp8BlockConfig(QuantizationConfig):
    name = "fp8"
    bits_per_weight = 8.0  # the block scales are 4 bytes per bn x bk weights
    experts_format = "dequantized"  # what the plan counts for routed experts (memory_plan.weights_format)

    def __init__(self, block: tuple[int, int], ignored_layers: list[str] | None = None):
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"fp8: weight_block_size {list(block)} is not [rows, columns] of positive sizes.")
        self.block = (int(block[0]), int(block[1]))
        self.ignored_layers = list(ignored_layers or [])
        # Checkpoint names of the weights of the layers given Fp8BlockLinearMethod (filled as the model is built).
        self.layer_weight_names: set[str] = set()

    def get_quant_method(self, prefix):
        if self.skipped(prefix, self.ignored_layers) or block_fp8_dequantized_at_load(prefix):
            return None
        self.layer_weight_names.update(f"{name}.weight" for name in checkpoint_names(prefix))
        return Fp8BlockLinearMethod(self.block)

    def get_moe_method(self, prefix):
        return None

    def read_weights(self, weights: Iterable, model_path: Path, dtype: torch.dtype, device) -> Iterator:
        quantized = block_fp8_weights(checkpoint_tensors(model_path))
        # By name, not by the layers built here: another pipeline stage's weights pass through untouched (the
        # model skips them).
        experts = {n for n in quantized if self._dequantized_at_read(n)}
        logger.info("FP8 block-wise checkpoint (weight_block_size %s): %d weights served in FP8, %d (routed experts: "
                    "no block-scaled grouped GEMM yet; ignored layers) dequantized to %s as read", list(self.block),
                    len(quantized) - len(experts), len(experts), str(dtype).removeprefix("torch."))
        return self._quantize_float_layers(dequantized_weights(weights, experts, self.block, dtype, device), device)

    def _dequantized_at_read(self, name: str) -> bool:
        prefix = name.removesuffix(".weight")
        return block_fp8_dequantized_at_load(prefix) or self.skipped(prefix.removeprefix("model."),
                                                                     self.ignored_layers)

    def _served_as_stored(self, name: str) -> bool:
        return name.removeprefix("model.") in self.layer_weight_names or name in self.layer_weight_names

    def _quantize_float_layers(self, weights: Iterable, device) -> Iterator:
        """A layer built for FP8 whose checkpoint weight is a float one (left unquantized by the tool that wrote
        it): quantized here block by block, so every layer of the model has one layout."""
        for name, tensor in weights:
            # The dtype comes from the header: a weight served as stored stays lazy (a TP rank reads its slice).
            if self._served_as_stored(name) and tensor.dtype != torch.float8_e4m3fn:
                q, scale_inv = quantize_block(as_tensor(tensor).to(device), self.block)
                yield name, q
                yield name + SCALE_SUFFIX, scale_inv
                continue
            yield name, tensor


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float [N, K] weight -> (e4m3, scale_inv [ceil(N/bn), ceil(K/bk)]): each block's max |w| maps to 448."""
    from kvserve.ops.fp8_e4m3 import FP8_MAX

    bn, bk = block
    n, k = w.shape
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=torch.float32, device=w.device)
    pad[:n, :k] = w.float()
    blocks = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(pad)[:n, :k].to(torch.float8_e4m3fn)
    return q, scale


class Fp8BlockLinearMethod(LinearMethodBase):
    """weight e4m3 [N, K] and weight_scale_inv float32 [scale rows, ceil(K / bk)] of this rank's slice, plus
    the buffer scale_row [N] (int32): the scale row of each output row."""

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        bn, bk = self.block
        n, k = sum(output_partition_sizes), input_size_per_partition
        k_start = getattr(layer, "tp_rank", 0) * k if k != input_size else 0
        if k_start % bk:
            raise ValueError(f"fp8: this rank's {k} input features start at feature {k_start}, inside a "
                             f"{bk}-wide block of the checkpoint's weight_block_size; choose a "
                             f"--tensor-parallel-size that splits {input_size} at multiples of {bk}")
        layer.register_parameter("weight", new_param((n, k), torch.float8_e4m3fn, output_dim=0, input_dim=1,
                                                     format_hint="fp8 weight: float8_e4m3fn [out, in]"))
        # Each part (q/k/v, gate/up) of this rank: rows [start, start + size) of the checkpoint's part tensor,
        # at `offset` in the layer, covering that part's scale rows [start // bn, ceil((start + size) / bn)).
        parts, rows, scale_rows = {}, [], 0
        for index, (offset, size, start) in enumerate(_parts(layer, output_partition_sizes)):
            first, end = start // bn, -(-(start + size) // bn)
            parts[index] = (scale_rows, first, end - first)
            rows.append(scale_rows - first + torch.arange(start, start + size) // bn)
            scale_rows += end - first
        scale = new_param((scale_rows, -(-k // bk)), torch.float32,
                          format_hint=f"fp8 weight_scale_inv: float32 [ceil(out / {bn}), ceil(in / {bk})]")
        def load_scale(param, loaded, shard_id=None):
            if shard_id is None and len(parts) > 1:
                raise ValueError("a block-wise FP8 checkpoint that stores this merged projection as one tensor is "
                                 "not supported; its parts (q/k/v, gate/up) must be stored apart")
            index = getattr(layer, "_SHARDS", {}).get(shard_id, shard_id or 0)
            _load_scale(param, loaded, parts[index], k_start // bk)

        scale.weight_loader = load_scale
        layer.register_parameter("weight_scale_inv", scale)
        layer.register_buffer("scale_row", torch.cat(rows).to(torch.int32), persistent=False)

    def apply(self, layer, x, bias=None):
        x2 = x.reshape(-1, x.shape[-1])
        if use_fused_kernels(x2) and x2.shape[0] <= W8A16_MAX_ROWS:
            from kvserve.ops.triton_fp8_gemm import w8a16_gemm

            out = w8a16_gemm(x2, layer.weight, layer.weight_scale_inv, group_k=self.block[1],
                             scale_row=layer.scale_row)
            out = out if bias is None else out + bias
        else:
            out = torch.nn.functional.linear(x2, self.dequantized_weight(layer, x.dtype), bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def dequantized_weight(self, layer, dtype: torch.dtype) -> torch.Tensor:
        if use_fused_kernels(layer.weight):
            from kvserve.ops.fp8_group_dequant import dequantize_groups_triton

            return dequantize_groups_triton(layer.weight, layer.weight_scale_inv, layer.scale_row, self.block[1],
                                            dtype)
        from kvserve.ops.fp8_group_dequant import dequantize_groups

        return dequantize_groups(layer.weight, layer.weight_scale_inv, layer.scale_row, self.block[1], dtype)


def _parts(layer, output_partition_sizes: list[int]) -> list[tuple[int, int, int]]:
    """(offset in this rank's weight, rows, first row in the checkpoint's part tensor) of each part the layer
    loads (q/k/v, gate/up, or the one weight), as its weight loader cuts them."""
    if hasattr(layer, "_shard"):  # merged column-parallel layers (their part attributes are set by now)
        return [layer._shard(i) for i in range(len(output_partition_sizes))]
    (size,) = output_partition_sizes
    return [(0, size, getattr(layer, "tp_rank", 0) * size if size != layer.output_size else 0)]


def _load_scale(param, loaded, part: tuple[int, int, int], k_block_start: int) -> None:
    """This rank's scale rows of one part (its rows' blocks) and scale columns (its input slice's blocks)."""
    scale_offset, first, count = part
    loaded = as_tensor(loaded)
    if loaded.dim() != 2 or loaded.shape[0] < first + count or loaded.shape[1] < k_block_start + param.shape[1]:
        raise ValueError(f"weight_scale_inv of shape {tuple(loaded.shape)} is too small for this rank's blocks "
                         f"(rows {first}..{first + count}, columns {k_block_start}..{k_block_start + param.shape[1]})")
    loaded = loaded[first:first + count, k_block_start:k_block_start + param.shape[1]]
    copy_into(param.data[scale_offset:scale_offset + count], loaded.float(), "weight_scale_inv")


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
                     ) -> torch.Tensor:
    """q e4m3 [..., N, K] times its bn x bk blocks' factors scale_inv [..., ceil(N/bn), ceil(K/bk)], in dtype."""
    bn, bk = block
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not match a weight of shape "
                         f"{tuple(q.shape)} in blocks of {bn} x {bk} (expected {want})")
    from kvserve.ops.fp8_group_dequant import dequantize_groups

    return dequantize_groups(q, scale_inv, torch.arange(n, device=q.device) // bn, bk, dtype)


def dequantized_weights(weights: Iterable, quantized: set[str], block: tuple[int, int], dtype: torch.dtype,
                        device) -> Iterator:
    """The (name, tensor) stream with each weight named in `quantized` dequantized (on `device`) and its
    scale_inv consumed; the two may come in either order, from different shards."""
    waiting_weight: dict[str, torch.Tensor] = {}
    waiting_scale: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        base = name.removesuffix(SCALE_SUFFIX)
        if name.endswith(SCALE_SUFFIX) and base in quantized:
            scale = as_tensor(tensor).to(device)
            if base in waiting_weight:
                yield base, _dequantize(base, waiting_weight.pop(base), scale, block, dtype)
            else:
                waiting_scale[base] = scale
        elif name in quantized:
            q = as_tensor(tensor).to(device)
            if name in waiting_scale:
                yield name, _dequantize(name, q, waiting_scale.pop(name), block, dtype)
            else:
                waiting_weight[name] = q
        else:
            yield name, tensor
    if waiting_weight or waiting_scale:
        name = next(iter(waiting_weight or waiting_scale))
        raise ValueError(f"the checkpoint lists {name}{SCALE_SUFFIX} but lacks one of the pair; is every "
                         f"*.safetensors shard present?")


def _dequantize(name: str, q: torch.Tensor, scale: torch.Tensor, block, dtype) -> torch.Tensor:
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: a block-wise FP8 weight must be float8_e4m3fn, not {q.dtype}")
    try:
        return dequantize_block(q, scale, block, dtype)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
