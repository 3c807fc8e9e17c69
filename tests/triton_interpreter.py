"""Triton kernel tests on a machine without a GPU: they run under Triton's interpreter, which must be switched
on (TRITON_INTERPRET=1) before triton is first imported, so a test file re-runs itself in a fresh pytest
subprocess with it set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_file_in_interpreter(test_file: str, timeout: float = 900) -> str:
    """Runs `test_file` under the interpreter; fails with its output unless it passed; returns the output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test_file]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreter run failed (rc {proc.returncode}):\n{out[-20000:]}"
    return out
