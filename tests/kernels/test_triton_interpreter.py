"""The CPU tier of the Triton kernel tests: each kernel test file, run in a pytest subprocess under Triton's
interpreter (see tests/triton_interpreter.py). The GPU tier runs the same files compiled: `pytest -m gpu`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.triton_interpreter import INTERPRETED, run_file_in_interpreter

pytest.importorskip("triton")

KERNEL_TEST_FILES = ["test_triton_attention.py", "test_triton_attention_window.py", "test_triton_attention_sinks.py",
                     "test_quant_kernels.py", "test_fused_kernels.py", "test_moe_routing.py",
                    "test_moe_align.py", "test_moe_sum.py"]


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
@pytest.mark.parametrize("name", KERNEL_TEST_FILES)
def test_kernels_in_interpreter(name):
    out = run_file_in_interpreter(str(Path(__file__).with_name(name)))
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary and "error" not in summary, out[-3000:]
    print(summary)
