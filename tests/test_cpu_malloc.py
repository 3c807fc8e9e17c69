"""glibc malloc tuning of the CPU path: freed activation-sized buffers are reused without page faults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.worker import cpu_malloc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

# Allocates and frees a 50 MB tensor a few times (like one layer's gate_up output each step) and prints the
# page faults of the last rounds.
_CHILD = """
import resource, sys, torch
from kvserve.worker.cpu_malloc import tune_malloc_for_cpu_inference
if sys.argv[1] == "tuned":
    assert tune_malloc_for_cpu_inference()
for i in range(4):
    if i == 2:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(4096, 3072)
    del x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_tuned_reuses_freed_buffers_without_page_faults():
    tuned, default = _faults("tuned"), _faults("default")
    assert tuned < 1000, tuned  # 2 x 50 MB: 25,600 4-KiB pages if every round faulted its pages in again
    assert default > tuned


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_MALLOC_TUNE", "0")
    assert not cpu_malloc.tune_malloc_for_cpu_inference()
