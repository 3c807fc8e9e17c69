"""Preemptions explained: one log line per preemption (rate-limited), and a warning with advice in the
tuning order when they come too often. Preemption is the first thing to look at when throughput is low:
each one throws away (or copies out) K/V that must come back before the request can go on."""

from __future__ import annotations

import logging
import time
from collections import deque

logger = logging.getLogger("kvserve.preemption")


class PreemptionLog:
    def __init__(self, max_num_seqs: int, gpu_memory_utilization: float, preemption_mode: str,
                 lines_per_window: int = 10, window_seconds: float = 10.0, warn_per_minute: int = 30,
                 clock=time.monotonic):
        self.max_num_seqs = max_num_seqs
        self.gpu_memory_utilization = gpu_memory_utilization
        self.preemption_mode = preemption_mode
        self.lines_per_window = lines_per_window
        self.window_seconds = window_seconds
        self.warn_per_minute = warn_per_minute
        self.clock = clock
        self._window_start = clock()
        self._lines_in_window = 0
        self._suppressed = 0
        self._recent: deque[float] = deque()  # times of the preemptions of the last minute
        self._last_warning = float("-inf")

    def report(self, events) -> None:
        now = self.clock()
        if now - self._window_start >= self.window_seconds:
            if self._suppressed:
                logger.info("... %d more preemptions in the last %.0f s were not logged one by one",
                            self._suppressed, now - self._window_start)
            self._window_start, self._lines_in_window, self._suppressed = now, 0, 0
        for e in events:
            self._recent.append(now)
            if self._lines_in_window >= self.lines_per_window:
                self._suppressed += 1
                continue
            self._lines_in_window += 1
            what = (f"{e.num_tokens} tokens to recompute" if e.mode == "recompute"
                    else f"{e.num_blocks} blocks ({e.num_tokens} tokens) swapped to CPU")
            logger.info("Preempted request %s (%s): %s; KV cache usage %.1f%%, %d running, %d waiting",
                        e.request_id, e.mode, what, 100 * e.kv_usage, e.num_running, e.num_waiting)
        while self._recent and now - self._recent[0] > 60:
            self._recent.popleft()
        if len(self._recent) > self.warn_per_minute and now - self._last_warning > 60:
            self._last_warning = now
            running = max((e.num_running for e in events), default=1)
            logger.warning("%s", self.advice(len(self._recent), running))

    def advice(self, per_minute: int, num_running: int) -> str:
        """The tuning order: KV headroom first, then the batch; swap last (it trades recompute for copies)."""
        steps = []
        if self.gpu_memory_utilization < 0.95:
            steps.append(f"more KV cache with --gpu-memory-utilization "
                         f"{min(0.95, round(self.gpu_memory_utilization + 0.05, 2))}")
        steps.append(f"a smaller batch with --max-num-seqs {max(1, min(self.max_num_seqs - 1, num_running))} (the KV "
                     f"cache holds about that many of these requests)")
        if self.preemption_mode == "recompute":
            steps.append("or add --swap-space 4 --preemption-mode auto (copy long requests' K/V instead of "
                         "recomputing it)")
        return (f"{per_minute} preemptions in the last minute: the KV cache is too small for this load, and "
                f"preempted requests redo work. In the tuning order: {'; '.join(steps)}. `kvserve plan` shows "
                f"the KV capacity.")
