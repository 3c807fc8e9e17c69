"""The two tiers of the Triton kernel tests.

* CPU (CI): Triton's interpreter runs the kernels on CPU tensors. It must be switched on
  (TRITON_INTERPRET=1) before triton is first imported, so tests/kernels/test_triton_interpreter.py re-runs each
  kernel test file in a fresh pytest subprocess with it set.
* GPU (`pytest -m gpu`): the same tests, compiled, on CUDA tensors. Outside the interpreter every kernel
  test carries the `gpu` mark (KERNEL_TIER), which conftest.py skips where there is no CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Where a kernel test puts its tensors: the interpreter reads CPU memory, compiled kernels need CUDA memory.
KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda"
# A kernel test file's `pytestmark`: the gpu tier, except inside the interpreter run.
KERNEL_TIER = [] if INTERPRETED else [pytest.mark.gpu]
# For the few cases that only the compiled tier can check (the interpreter's bf16 tl.dot multiplies raw bits).
compiled_only = pytest.mark.skipif(INTERPRETED, reason="the interpreter cannot run this case (bf16 tl.dot)")
# For the cases that would add compiled variants (a compile each, ~1-2 s) but no coverage beyond the GPU tier's
# other cases; the interpreter compiles nothing and keeps them. Under the interpreter, `-m "not interpreter_only"`
# runs what the GPU tier runs (less its compiled_only cases).
interpreter_only = [pytest.mark.interpreter_only,
                    pytest.mark.skipif(not INTERPRETED, reason="compiled: a variant the other cases cover")]


def gpu_tier_cases(cases, on_gpu, case_id) -> list:
    """pytest.param for each case (a tuple of the parametrized values), named case_id(*case), marked
    interpreter_only unless on_gpu(*case)."""
    return [pytest.param(*case, id=case_id(*case), marks=() if on_gpu(*case) else interpreter_only)
            for case in cases]


def interpreter_unusable() -> str | None:
    """Why this triton's interpreter cannot run here, or None. Triton 3.6's interpreter turns a loop bound
    into a python int with int(1-element array), which numpy >= 2.4 refuses; triton 3.7 fixed it (the GPU
    image pairs triton 3.6 with numpy 2.5)."""
    import numpy
    import triton

    def version(text: str) -> tuple[int, int]:
        major, minor = text.split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)

    if version(triton.__version__) < (3, 7) and version(numpy.__version__) >= (2, 4):
        return f"triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__}: use triton>=3.7"
    return None


def run_file_in_interpreter(test_file: str, timeout: float = 900) -> str:
    """Runs `test_file` under the interpreter; fails with its output unless it passed; returns the output."""
    reason = interpreter_unusable()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test_file]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreter run failed (rc {proc.returncode}):\n{out[-20000:]}"
    return out
