"""The one layout AWQ and GPTQ weights are served in, after loading:

* ``qweight``  int32 [K / pack, N]: pack = 32 // bits values of consecutive input rows k per element,
  row k in bits ``(k % pack) * bits`` (GPTQ's own order; AWQ is repacked into it),
* ``scales``   [G, N] float, ``zeros`` [G, N] float (the real zero point, offsets already resolved),
* ``g_idx``    int32 [K]: the group of input row k (act-order), or None for groups of consecutive rows.

W[k, n] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n] and y = x @ W. On CUDA (and on the CPU under
TRITON_INTERPRET=1) int_matmul.py picks a Triton kernel by the number of rows (split-K skinny GEMM for
decode, dequantize + cuBLAS above); elsewhere the reference
path below dequantizes, then multiplies.
"""

from __future__ import annotations

import os

import torch
from torch import nn

_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, N] holding pack values per element along dim 0 -> int32 [R * pack, N]."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    vals = (packed.unsqueeze(1) >> shifts.view(1, pack, 1)) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0] * pack, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 [R, N] holding pack values per element along dim 1 -> int32 [R, N * pack]. `order[i]` is the
    column (within the element's pack) stored in its i-th field (AWQ interleaves; GPTQ is sequential)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, N, pack], field i
    if order is not None:
        cols = torch.empty_like(fields)
        cols[..., torch.tensor(order, device=packed.device)] = fields
        fields = cols
    return fields.reshape(packed.shape[0], packed.shape[1] * pack)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int [K, N] in [0, 2**bits) -> int32 [K / pack, N] (inverse of unpack_rows)."""
    pack = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0] // pack, pack, values.shape[1])
    out = torch.zeros(v.shape[0], v.shape[2], dtype=torch.int64, device=values.device)
    for i in range(pack):
        out |= v[:, i] << (i * bits)
    return _to_int32(out)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    # Values use all 32 bits: reinterpret the unsigned pattern as two's complement.
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


class IntWeights:
    """Registers the served layout on a layer (replacing the checkpoint's parameters) and applies it."""

    @staticmethod
    def install(layer: nn.Module, bits: int, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                g_idx: torch.Tensor | None, group_size: int) -> None:
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if name in layer._parameters:
                del layer._parameters[name]
        layer.__dict__.pop("_dequantized_reference", None)
        layer.quant_bits = bits
        layer.group_size = group_size
        layer.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(scales.contiguous(), requires_grad=False)
        layer.zeros = nn.Parameter(zeros.to(scales.dtype).contiguous(), requires_grad=False)
        layer.g_idx = None if g_idx is None else nn.Parameter(g_idx.to(torch.int32).contiguous(), requires_grad=False)

    @staticmethod
    def dequantize(layer: nn.Module) -> torch.Tensor:
        """W [K, N] in the scales' dtype (exact (q - z) * s, computed in fp32)."""
        q = unpack_rows(layer.qweight, layer.quant_bits)
        k, n = q.shape
        if layer.g_idx is None:  # consecutive groups: broadcast instead of gathering
            q = q.view(k // layer.group_size, layer.group_size, n)
            w = (q.float() - layer.zeros.float()[:, None]) * layer.scales.float()[:, None]
            return w.reshape(k, n).to(layer.scales.dtype)
        groups = layer.g_idx.long()
        w = (q.float() - layer.zeros.float()[groups]) * layer.scales.float()[groups]
        return w.to(layer.scales.dtype)

    @staticmethod
    def apply(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda or _TRITON_INTERPRET:
            from kvserve.model.quantization.int_matmul import int_matmul

            out = int_matmul(x.reshape(-1, x.shape[-1]), layer.qweight, layer.scales, layer.zeros, layer.g_idx,
                             layer.quant_bits, layer.group_size)
            out = out.reshape(*x.shape[:-1], out.shape[-1])
        else:
            # The CPU reference path (tests, small models) keeps the dequantized weight after its first use:
            # dequantizing every step costs several times the matmul itself. Not a parameter, so the
            # logged weight bytes stay those of the packed weights; GPUs never build it.
            w = getattr(layer, "_dequantized_reference", None)
            if w is None or w.dtype != x.dtype:
                w = layer._dequantized_reference = IntWeights.dequantize(layer).to(x.dtype)
            out = torch.matmul(x, w)
        return out if bias is None else out + bias
