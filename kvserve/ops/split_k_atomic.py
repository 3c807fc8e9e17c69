"""Split-K in one launch: the programs of an output tile add their fp32 partials into a per-device workspace,
and the last to arrive (a per-tile counter tells) writes the tile in the output dtype and zeroes its part of
the workspace and its counter for the next call. No memset, no reduction kernel, no cast kernel, no host
sync: CUDA-graph capturable. One workspace per device serves every layer (kernels of one stream run one
after the other). Shared by the weight-streaming GEMM kernels of kvserve/ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Made at the first call (eager: CUDA-graph warm-up runs before capture) at least this size; a call needing
# more while a graph is being captured gets None, and runs unsplit instead of allocating.
_MIN_FLOATS = 256 * 8192
_MIN_COUNTERS = 4096
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_retired: list[tuple[torch.Tensor, torch.Tensor]] = []  # grown-out-of buffers a captured graph may still use


def workspace(device: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fp32 partial sums, int32 tile counters), all zero, of at least these sizes; None: split-K unavailable."""
    ws = _workspaces.get(device)
    if ws is not None and ws[0].numel() >= floats and ws[1].numel() >= counters:
        return ws
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if ws is not None:
        _retired.append(ws)
    ws = (torch.zeros(max(floats, _MIN_FLOATS), dtype=torch.float32, device=device),
          torch.zeros(max(counters, _MIN_COUNTERS), dtype=torch.int32, device=device))
    _workspaces[device] = ws
    return ws


def is_clean(device: torch.device) -> bool:
    """Whether the device's workspace is all zero again (what the next call and a graph replay rely on)."""
    ws = _workspaces.get(device)
    return ws is None or (not ws[0].any() and not ws[1].any())


@triton.jit
def store_tile(part, out_ptr, out_off, ws_ptr, ws_off, out_ok, cnt_ptr, tile, split_k, SPLIT: tl.constexpr):
    """Writes the fp32 partial `part` of output tile `tile` (element offsets out_off in the output, ws_off in
    the workspace); unsplit: a plain store."""
    if SPLIT:
        ws = ws_ptr + ws_off
        tl.atomic_add(ws, part, mask=out_ok, sem="relaxed")
        tl.debug_barrier()  # every thread's partial is in before the tile's counter moves
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:  # the tile's last program: the others' partials are all in
            # Read through L2 (an atomic, not a possibly stale L1 line), then clean up for the next call.
            total = tl.atomic_add(ws, tl.zeros_like(part), mask=out_ok, sem="relaxed")
            tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=out_ok)
            tl.store(ws, tl.zeros_like(part), mask=out_ok)
            tl.store(cnt_ptr + tile, 0)
    else:
        tl.store(out_ptr + out_off, part.to(out_ptr.dtype.element_ty), mask=out_ok)
