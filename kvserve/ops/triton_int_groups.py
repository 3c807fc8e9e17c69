"""The scales and zero points of packed int weights inside Triton kernels (the int kernels share it):
per weight row from its group (`row // group_size`, or GPTQ act-order's `g_idx[row]`), or one row of them
when a whole tile lies in one group."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def group_scales_zeros(s_ptr, z_ptr, g_ptr, rows, rows_ok, offs_n, tile_ok, N,
                       GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr):
    """fp32 [len(rows), len(offs_n)] scales and zeros of weight rows `rows` in columns `offs_n`."""
    if HAS_G_IDX:
        group = tl.load(g_ptr + rows, mask=rows_ok, other=0)
    else:
        group = rows // GROUP_SIZE
    offsets = group[:, None].to(tl.int64) * N + offs_n[None, :]
    s = tl.load(s_ptr + offsets, mask=tile_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offsets, mask=tile_ok, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def tile_group_scales_zeros(s_ptr, z_ptr, first_row, offs_n, n_ok, N, GROUP_SIZE: tl.constexpr):
    """fp32 [1, len(offs_n)] scales and zeros when every row of the tile from `first_row` is in one group."""
    offsets = (first_row // GROUP_SIZE) * N + offs_n  # groups * N < 2**31 for any real layer
    s = tl.load(s_ptr + offsets, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    z = tl.load(z_ptr + offsets, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return s, z
