"""Where an engine step's wall time goes: host time per phase, and the GPU's busy time over a window of steps.

`StepPhases(engine)` wraps the engine's phases (on the instance, nothing else changes) and sums their wall
time; `report()` gives milliseconds per step. The phases nest as the step does:

    step          engine.step(), the whole call
    schedule      the scheduler's pick (and the grammar bitmask, when it is filled before the launch)
    launch        executor.execute_async: inputs built and the forward queued (eagerly or a graph replay)
    read back     a launched step's tokens read back and given to the scheduler, of which:
      wait          waiting for them (the device still busy with the step)
      update        scheduler.update (matchers advance there)
    mask fill     the grammar bitmask filled after the update (async scheduling's deferred mask)
    mask send     that bitmask handed to the runner, which applies it and queues the sampling
    outputs       the output processor (detokenizing, stop strings, RequestOutputs)

`gpu_window(engine, first, count)` profiles steps first .. first + count - 1 with torch.profiler and gives
the GPU's busy milliseconds per step (kernels and copies, summed) beside those steps' wall time: busy well
below wall is the device waiting for the host.
"""

from __future__ import annotations

import contextlib
import time

import torch


class StepPhases:
    def __init__(self, engine):
        self.engine = engine
        self.seconds: dict[str, float] = {}
        self.steps = 0
        self._undo: list = []
        so = engine.structured_output
        targets = [("step", engine, "step"), ("schedule", engine, "_schedule"),
                   ("launch", engine.executor, "execute_async"), ("read back", engine, "_update"),
                   ("update", engine.scheduler, "update"), ("outputs", engine, "_make_outputs"),
                   ("mask send", engine.executor, "send_grammar_bitmask")]
        if so is not None:
            targets.append(("mask fill", so, "grammar_bitmask"))
        for phase, owner, name in targets:
            self._wrap(phase, owner, name)

    def _wrap(self, phase: str, owner, name: str) -> None:
        inner = getattr(owner, name)
        had_own = name in vars(owner)
        seconds = self.seconds
        seconds.setdefault(phase, 0.0)
        counts_steps = phase == "step"

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - t
                if counts_steps:
                    self.steps += 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, inner if had_own else None))

    def reset(self) -> None:
        for phase in self.seconds:
            self.seconds[phase] = 0.0
        self.steps = 0

    def report(self) -> dict[str, float]:
        """Milliseconds per step by phase (and `wait`: read back less update), with the step count."""
        n = max(1, self.steps)
        ms = {phase: 1e3 * s / n for phase, s in self.seconds.items()}
        ms["wait"] = ms["read back"] - ms["update"]
        ms["steps"] = self.steps
        return ms

    def remove(self) -> None:
        for owner, name, own in reversed(self._undo):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._undo.clear()


def format_phases(ms: dict[str, float]) -> str:
    order = ["step", "schedule", "launch", "read back", "wait", "update", "mask fill", "mask send", "outputs"]
    return ", ".join(f"{p} {ms[p]:.2f}" for p in order if p in ms) + f" ms/step over {ms['steps']} steps"


@contextlib.contextmanager
def gpu_window(engine, first: int, count: int, result: dict):
    """Within the block, torch.profiler records engine steps first .. first + count - 1 (counted from 0 at the
    block's start, first >= 1); on exit `result` holds busy_ms and wall_ms per step over them, the step count profiled,
    and the top kernels by device time (name, ms per step)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    had_own = "step" in vars(engine)
    inner = engine.step
    marks: list[float] = []  # after each step
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=first - 1, warmup=1, active=count, repeat=1))

    def step(*args, **kwargs):
        out = inner(*args, **kwargs)
        if len(marks) in (first - 1, first + count - 1):  # the window's edges: the device caught up
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
        prof.step()
        return out

    engine.step = step
    prof.start()
    try:
        yield result
    finally:
        prof.stop()
        if had_own:
            engine.step = inner
        else:
            del engine.step
        profiled = min(count, max(0, len(marks) - first))
        result.update(steps=profiled)
        if profiled:
            # The profiler's own per-step range spans the step's kernels: not counted twice.
            events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.key.startswith("ProfilerStep")]
            busy = sum(e.self_device_time_total for e in events) / 1e3
            wall = 1e3 * (marks[first + profiled - 1] - marks[first - 1])
            result.update(busy_ms=busy / profiled, wall_ms=wall / profiled,
                          top_kernels=[(e.key[:70], e.self_device_time_total / 1e3 / profiled) for e in
                                       sorted(events, key=lambda e: -e.self_device_time_total)[:8]])
