"""Process groups of one engine: which tensor-parallel and pipeline rank this process is, and the
collectives the model needs (all-reduce and all-gather inside a TP group, send/recv between stages).

Rank layout as vLLM's: global rank = pp_rank * tp_size + tp_rank, so a TP group is tp_size consecutive
ranks (on one node when ranks fill nodes in order) and pipeline stages follow one another.
Nothing here knows about models. Without `init_distributed` this process is rank 0 of a world of one,
and every collective is the identity (the in-process `uni` executor never creates a process group).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Bounds the rendezvous at start-up and every collective after it: a peer that never arrives
# (a worker that failed to start, a node that did not join) becomes an error, never a hang.
DEFAULT_TIMEOUT_S = float(os.environ.get("KVSERVE_DIST_TIMEOUT", "120"))


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    tp_group: object = None
    pp_group: object = None  # this process's ranks with the same tp_rank, one per stage
    # --enable-expert-parallel: MoE layers place whole experts on the ranks of the TP group (the expert-parallel
    # group is the TP group) instead of splitting each expert over them.
    expert_parallel: bool = False

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the process with this tp_rank on stage pp_rank."""
        return pp_rank * self.tp_size + self.tp_rank


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def init_distributed(rank: int, tp_size: int, pp_size: int, init_method: str, backend: str,
                     timeout_s: float = DEFAULT_TIMEOUT_S, expert_parallel: bool = False) -> ParallelState:
    """Joins the world of tp_size * pp_size processes at `init_method` and builds the TP and PP groups."""
    import torch.distributed as dist

    global _STATE
    world = tp_size * pp_size
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timeout)
    except Exception as e:  # noqa: BLE001 - re-raised with what was missing
        raise RuntimeError(
            f"rank {rank}: the rendezvous of {world} processes at {init_method} failed after at most "
            f"{timeout_s:.0f} s ({type(e).__name__}: {e}); a worker did not start or cannot reach the "
            f"others (set KVSERVE_DIST_TIMEOUT to wait longer)"
        ) from e
    state = ParallelState(rank=rank, world_size=world, tp_size=tp_size, pp_size=pp_size,
                          expert_parallel=expert_parallel)
    # Every process creates every group, in the same order (new_group is itself a collective).
    for p in range(pp_size):
        ranks = list(range(p * tp_size, (p + 1) * tp_size))
        group = dist.new_group(ranks, timeout=timeout) if tp_size > 1 else None
        if rank in ranks:
            state.tp_group = group
    for t in range(tp_size):
        ranks = list(range(t, world, tp_size))
        group = dist.new_group(ranks, timeout=timeout) if pp_size > 1 else None
        if rank in ranks:
            state.pp_group = group
    _STATE = state
    return state


class CommTimer:
    """Time spent in this process's collectives and stage-to-stage transfers, for benchmarks.

    Off unless KVSERVE_COMM_TIMER=1 (one module-level check per call when off). On CUDA each call is
    bracketed by two events (no synchronization; resolved when read or when they have completed); calls
    made while a CUDA graph is being captured are not timed, so graph replays are invisible to it:
    `summary()` counts separately the steps that ran their layers' collectives from Python (eager steps:
    an all-reduce or a stage transfer; the logits' all-gather runs outside the graphs in every step).
    A recv's time includes waiting for the sending stage.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds = {}  # kind -> seconds
        self.calls = {}
        self._pending = []  # (kind, start event, end event)
        self.steps = 0
        self.eager_steps = 0
        self._layer_calls = 0  # all-reduces and stage transfers made from Python
        self._layer_calls_at_step_start = 0

    def _end_step(self) -> None:
        if self._layer_calls > self._layer_calls_at_step_start:
            self.eager_steps += 1
        self._layer_calls_at_step_start = self._layer_calls

    def begin_step(self) -> None:
        if self.steps:
            self._end_step()
        self.steps += 1
        self._resolve(block=False)

    def time(self, kind: str, on_cuda: bool, fn, *args, **kwargs):
        if on_cuda and torch.cuda.is_current_stream_capturing():
            return fn(*args, **kwargs)
        self.calls[kind] = self.calls.get(kind, 0) + 1
        if kind != "all_gather":
            self._layer_calls += 1
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self._pending.append((kind, start, end))
            return out
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0
        return out

    def _resolve(self, block: bool) -> None:
        if block and self._pending:
            self._pending[-1][2].synchronize()
        keep = []
        for kind, start, end in self._pending:
            if block or end.query():
                self.seconds[kind] = self.seconds.get(kind, 0.0) + start.elapsed_time(end) / 1000
            else:
                keep.append((kind, start, end))
        self._pending = keep

    def summary(self) -> dict:
        if self.steps:
            self._end_step()  # the last step's calls
        self._resolve(block=True)
        return dict(seconds=dict(self.seconds), calls=dict(self.calls), steps=self.steps,
                    eager_steps=self.eager_steps)


COMM_TIMER: CommTimer | None = CommTimer() if os.environ.get("KVSERVE_COMM_TIMER") == "1" else None


def _timed(kind: str, tensor: torch.Tensor, fn, *args, **kwargs):
    if COMM_TIMER is None:
        return fn(*args, **kwargs)
    return COMM_TIMER.time(kind, tensor.is_cuda, fn, *args, **kwargs)


def destroy_distributed() -> None:
    import torch.distributed as dist

    global _STATE
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE = ParallelState()


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group, in place (row-parallel layers' partial products)."""
    if _STATE.tp_size == 1:
        return x
    import torch.distributed as dist

    _timed("all_reduce", x, dist.all_reduce, x, group=_STATE.tp_group)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenation of every TP rank's x along dim, in rank order (vocab-parallel logits)."""
    if _STATE.tp_size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    _timed("all_gather", x, dist.all_gather, parts, x, group=_STATE.tp_group)
    return torch.cat(parts, dim=dim)


def send_to_next_stage(tensors: list[torch.Tensor]) -> None:
    import torch.distributed as dist

    dst = _STATE.stage_rank(_STATE.pp_rank + 1)
    for t in tensors:
        _timed("send", t, dist.send, t.contiguous(), dst=dst, group=_STATE.pp_group)


def recv_from_prev_stage(shapes: list[tuple], dtype: torch.dtype, device) -> list[torch.Tensor]:
    import torch.distributed as dist

    src = _STATE.stage_rank(_STATE.pp_rank - 1)
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        _timed("recv", t, dist.recv, t, src=src, group=_STATE.pp_group)
        out.append(t)
    return out
