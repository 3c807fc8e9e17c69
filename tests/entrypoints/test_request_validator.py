"""The one request validator (kvserve/request_limits.py): each limit is read by exactly one function of the
package, and the server and the `LLM` class refuse the same requests with the same message."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import pytest

import kvserve
from kvserve import LLM, SamplingParams
from kvserve import request_limits
from tests.server_utils import RemoteServer

ROOT = Path(kvserve.__file__).parent
# The module's limits: its upper-case constants (each a number, or a table of numbers), less the defaults
# of the operator's flags (--max-logprobs, --max-n: the flag's value is the limit, read from the config).
LIMITS = sorted(name for name, value in vars(request_limits).items()
                if name.isupper() and not name.startswith(("_", "DEFAULT_")) and isinstance(value, (int, float, dict)))


def _functions_reading(name: str) -> list[str]:
    """Every function of the package whose body (defaults and annotations aside) reads `name`."""
    found = []
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                reads = {n.id for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
                reads |= {n.attr for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Attribute)}
                if name in reads:
                    found.append(f"{path.relative_to(ROOT)}:{node.name}")
    return found


def test_the_limits_are_found():
    assert {"MAX_TEMPERATURE", "MAX_LIST_LENGTHS", "MAX_STOP_STRING_CHARS", "MAX_SPEC_CHARS", "MAX_TOOLS",
            "INT64_MAX", "MAX_REPETITION_PENALTY"} <= set(LIMITS)


@pytest.mark.parametrize("name", LIMITS)
def test_each_limit_is_checked_in_one_function(name):
    readers = _functions_reading(name)
    assert len(readers) == 1, f"{name} is read by {readers}"
    assert readers[0].startswith("request_limits.py:"), readers


def test_the_prompt_and_context_limits_have_one_function_each():
    """max_model_len is compared with a prompt in check_prompt_length alone, and with prompt + max_tokens in
    resolve_max_tokens alone (the API's rule); the vocabulary bound of prompt ids in check_token_ids."""
    src = (ROOT / "request_limits.py").read_text()
    tree = ast.parse(src)
    compares = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            text = ast.get_source_segment(src, node)
            compares[node.name] = text
    assert "> max_model_len" in compares["check_prompt_length"]
    assert [f for f, t in compares.items() if "> max_model_len" in t] == ["check_prompt_length"]
    assert [f for f, t in compares.items() if "num_prompt + max_tokens > limit" in t] == ["resolve_max_tokens"]


# ---- the same refusals from the server and the library -------------------------------------------------
MAX_MODEL_LEN = 64

# (completion request fields, the same request as SamplingParams fields for LLM.generate)
BAD_REQUESTS = [
    pytest.param({"prompt": [5] * (MAX_MODEL_LEN + 1)}, {}, id="prompt-longer-than-context"),
    pytest.param({"prompt": [10**6]}, {}, id="token-out-of-vocabulary"),
    pytest.param({"prompt": [5], "n": 500}, {"n": 500}, id="n-over-max-n"),
    pytest.param({"prompt": [5], "logprobs": 21}, {"logprobs": 21}, id="logprobs-over-max"),
    pytest.param({"prompt": [5], "top_k": 10**6}, {"top_k": 10**6}, id="top-k-over-vocabulary"),
    pytest.param({"prompt": [5], "temperature": 500.0}, {"temperature": 500.0}, id="temperature-range"),
    pytest.param({"prompt": [5], "stop_token_ids": [10**6]}, {"stop_token_ids": [10**6]}, id="stop-id-vocabulary"),
    pytest.param({"prompt": [5], "stop_token_ids": [1] * 5000}, {"stop_token_ids": [1] * 5000}, id="list-cap"),
    pytest.param({"prompt": [5], "seed": 2**70}, {"seed": 2**70}, id="seed-range"),
]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama")[0]


@pytest.fixture(scope="module")
def server(model_path):
    srv = RemoteServer(model_path, "--served-model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN),
                       "--kv-cache-memory-bytes", str(8 << 20))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=8 << 20)


@pytest.mark.parametrize("body, fields", BAD_REQUESTS)
def test_server_and_llm_refuse_alike(server, llm, body, fields):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    server_message = r.json()["error"]["message"]
    with pytest.raises(ValueError) as e:
        llm.generate([{"prompt_token_ids": body["prompt"]}], SamplingParams(**fields), use_tqdm=False)
    assert str(e.value) == server_message
