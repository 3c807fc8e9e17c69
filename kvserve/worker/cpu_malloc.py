"""glibc malloc settings for the CPU path: keep freed activation buffers in the heap instead of unmapping them.

A CPU step allocates activations of tens of MB (a 4,096-token prefill of SmolLM2-135M: 50 MB for gate_up,
25 MB for the MLP's intermediate). glibc serves blocks above its mmap threshold (dynamic, at most 32 MB) with
fresh mmaps and trims freed memory at the top of the heap back to the OS, so the same buffers are unmapped
and mapped again every layer: each new page is a page fault that the kernel zero-fills. On the 32 x 128 / 64
throughput workload that was ~750,000 faults and ~1.5 s of system time per run. Raising both thresholds lets
freed blocks be reused as they are (no faults); the cost is that up to M_TRIM_THRESHOLD of freed memory stays
with the process. Only the allocator's policy changes, not any result.

KVSERVE_CPU_MALLOC_TUNE=0 leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# Above any single activation of a CPU step (8,192 tokens x 3,072 x 4 bytes is 100 MB).
THRESHOLD_BYTES = 1 << 30


def enabled() -> bool:
    return os.environ.get("KVSERVE_CPU_MALLOC_TUNE", "1") != "0"


def tune_malloc_for_cpu_inference() -> bool:
    """Sets glibc's trim and mmap thresholds for this process; True when both were set. No-op (False) off
    glibc (musl, macOS) or when disabled."""
    if not enabled():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES) == 1 and mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
    if not ok:
        logger.info("glibc rejected the malloc thresholds; CPU activations may page-fault on every step")
    return ok
