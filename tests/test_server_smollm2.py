"""Real text from the default model through the server, and the README's curl and `openai` examples run as
printed (only the port differs: the test server listens on a free one)."""

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
