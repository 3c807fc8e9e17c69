"""Splitting a GEMM's K dimension over programs (decode shapes leave most SMs idle otherwise): the SM count,
the split in whole BLOCK_K tiles, and the fp32 partials the programs write and the caller sums."""

from __future__ import annotations

import functools

import torch

# What the kernels assume when there is no GPU to ask (the interpreter on CPU): an H100/H200's count.
DEFAULT_NUM_SMS = 132


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_NUM_SMS


def split_in_tiles(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(split_k, k_per_split) with every split starting at a multiple of block_k; split_k may shrink."""
    per_split = _cdiv(k, max(1, split_k))
    k_per_split = _cdiv(per_split, block_k) * block_k
    return _cdiv(k, k_per_split), k_per_split


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def partials(m: int, n: int, split_k: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, int]:
    """The kernel's output and its stride between splits: [M, N] in dtype when unsplit (stride 0), else
    [split_k, M, N] fp32 partials for `finish` to sum."""
    if split_k == 1:
        return torch.empty((m, n), dtype=dtype, device=device), 0
    out = torch.empty((split_k, m, n), dtype=torch.float32, device=device)
    return out, out.stride(0)


def finish(out: torch.Tensor, split_k: int, dtype: torch.dtype) -> torch.Tensor:
    return out if split_k == 1 else out.sum(0).to(dtype)
