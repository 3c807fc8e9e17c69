"""glibc malloc tuning of the CPU path: freed activation-sized buffers are reused without page faults."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from kvserve.worker import cpu_malloc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

# Allocates and frees a 50 MB and a 25 MB tensor per round (like one layer's gate_up output and MLP
# intermediate each step) and prints the page faults of the last six rounds. The first rounds grow the heap
# (a freed block sits below small live ones and the next aligned request is a little larger), so they are
# not counted: what matters is the steady state of a serving process.
# "tuned": the thresholds of tune_malloc_for_cpu_inference. "remap": a fixed 1 MB mmap threshold, so both
# buffers are mapped afresh every round: what the probe must count when buffers are not reused. glibc's own
# defaults are no baseline: its dynamic threshold moves the 50 MB buffer into the heap after a varying number
# of rounds (0 to ~74,000 faults in the counted rounds, run to run).
_CHILD = """
import ctypes, resource, sys, torch
from kvserve.worker import cpu_malloc
if sys.argv[1] == "tuned":
    assert cpu_malloc.tune_malloc_for_cpu_inference()
else:
    assert ctypes.CDLL("libc.so.6").mallopt(cpu_malloc.M_MMAP_THRESHOLD, 1 << 20) == 1
for i in range(12):
    if i == 6:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(4096, 3072)
    y = torch.ones(2048, 3072)
    del x, y
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
# The pages of one round's two buffers.
_ROUND_PAGES = (4096 + 2048) * 3072 * 4 // resource.getpagesize()


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_tuned_reuses_freed_buffers_without_page_faults():
    # Mapped afresh, six rounds fault in every page of their buffers: the probe sees what it must.
    remap = _faults("remap")
    assert remap >= 6 * _ROUND_PAGES, (remap, 6 * _ROUND_PAGES)
    # Tuned, the buffers are reused: over six rounds fewer faults than one round's buffers mapped afresh
    # (0 in the steady state; allowed one late heap growth of the 25 MB buffer, 6,144 pages).
    tuned = _faults("tuned")
    assert tuned < _ROUND_PAGES, (tuned, _ROUND_PAGES)


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_MALLOC_TUNE", "0")
    assert not cpu_malloc.tune_malloc_for_cpu_inference()
