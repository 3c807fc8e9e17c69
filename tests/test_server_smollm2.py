"""Real text from the default model through the server, and every `bash` and `python` block of the README runs
as printed after its two set-up commands (only the port differs: the test server listens on a free one)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_utils import RemoteServer

README = Path(__file__).resolve().parent.parent / "README.md"
README_URL = "http://127.0.0.1:8000"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(None, "--max-model-len", "1024")  # no MODEL: the embedded SmolLM2, as `make run`
    yield srv
    srv.stop()


def _readme_block(language: str, marker: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.DOTALL)
    matching = [b for b in blocks if marker in b]
    assert matching, f"README has no {language} block with {marker!r}"
    return matching[0]


def test_default_model_name_and_real_answer(server):
    client = server.openai_client()
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


def test_readme_curl_example(server):
    command = _readme_block("bash", "curl").replace(README_URL, server.url)
    out = subprocess.run(["bash", "-c", command], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"object":"chat.completion"' in out.stdout and "Paris" in out.stdout


def test_readme_openai_example(server):
    code = _readme_block("python", "from openai import OpenAI").replace(README_URL, server.url)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


SETUP_BLOCKS = {"make run", "make test"}  # the README's two set-up commands, run by CI itself
RUNNABLE = ("bash", "python")
ILLUSTRATION = ("sh", "text", "")  # need a GPU, network, Docker or the reader's files; never run here


def _all_blocks() -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_blocks_are_all_classified():
    langs = {lang for lang, _ in _all_blocks()}
    assert langs <= set(RUNNABLE + ILLUSTRATION), langs - set(RUNNABLE + ILLUSTRATION)
    assert {body.strip() for lang, body in _all_blocks() if lang == "bash"} >= SETUP_BLOCKS


def test_readme_every_runnable_block_runs_as_printed(server):
    """After `make run` (here: the module's server on a free port), each block exits 0, in README order."""
    repo = README.parent
    ran = 0
    for lang, body in _all_blocks():
        if lang not in RUNNABLE or body.strip() in SETUP_BLOCKS:
            continue
        code = body.replace(README_URL, server.url)
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        # A bound for hangs, not a speed check: the HF baseline alone takes minutes on a busy 2-core machine.
        out = subprocess.run(cmd, cwd=repo, check=False, capture_output=True, text=True, timeout=1800)
        assert out.returncode == 0, f"README block failed:\n{body}\n--- stderr ---\n{out.stderr[-3000:]}"
        ran += 1
    assert ran >= 6
