"""Real text from the default model through the server, and every `bash` and `python` block of the README runs
as printed after its two set-up commands (only the port differs: the test server listens on a free one)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_utils import RemoteServer

README = Path(__file__).resolve().parents[2] / "README.md"
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


def _run_block(lang: str, code: str) -> subprocess.CompletedProcess:
    """One README block, run in the checkout as a reader runs it; what it writes there is removed afterwards
    (`kvserve tune --results tune.jsonl` writes into the current directory), so the tests leave no files."""
    repo = README.parent
    before = set(os.listdir(repo))
    cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    try:
        # A bound for hangs, not a speed check: the HF baseline alone takes minutes on a busy 2-core machine.
        return subprocess.run(cmd, cwd=repo, check=False, capture_output=True, text=True, timeout=1800)
    finally:
        for name in set(os.listdir(repo)) - before:
            path = repo / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def test_readme_blocks_leave_no_files_in_the_checkout():
    made = README.parent / "written-by-a-readme-block.jsonl"
    assert _run_block("bash", f"echo '{{}}' > {made.name} && test -s {made.name}").returncode == 0
    assert not made.exists()


def test_readme_test_commands_say_what_they_need():
    """A pytest block needs the test extra: the README says to run `make install-test` before it."""
    text = README.read_text()
    blocks = [m for m in re.finditer(r"```(\w*)\n(.*?)```", text, flags=re.DOTALL) if "pytest" in m.group(2)]
    assert blocks
    for m in blocks:
        paragraph = text[:m.start()].rstrip().rsplit("\n\n", 1)[-1]
        assert "make install-test" in paragraph + m.group(2), m.group(2)


def test_readme_every_runnable_block_runs_as_printed(server):
    """After `make run` (here: the module's server on a free port), each block exits 0, in README order."""
    ran = 0
    for lang, body in _all_blocks():
        if lang not in RUNNABLE or body.strip() in SETUP_BLOCKS:
            continue
        out = _run_block(lang, body.replace(README_URL, server.url))
        assert out.returncode == 0, f"README block failed:\n{body}\n--- stderr ---\n{out.stderr[-3000:]}"
        ran += 1
    assert ran >= 6
