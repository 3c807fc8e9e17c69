"""One token count per request (the engine's RequestMetrics) feeds the API's usage, the Prometheus counters and
the dashboard: over a mixed load (n > 1, streaming, a stop string, several prompts) the usage sums equal the
counters' growth, which the dashboard shows too; an aborted stream adds what it was sent and nothing after."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_utils import RemoteServer

PROMPT, GEN = "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total"


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    srv = RemoteServer(path, "--max-model-len", "256", "--max-num-seqs", "8", "--dtype", "float32", "--seed", "0")
    yield srv
    srv.stop()


def _counters(server) -> tuple[float, float]:
    return server.metric(PROMPT), server.metric(GEN)


def _wait_idle(server) -> None:
    """Until the engine holds no request (the server noticed the client leave and aborted it)."""
    deadline = time.monotonic() + 120
    while server.metric("kvserve:num_requests_running") + server.metric("kvserve:num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "a request stayed in the engine"
        time.sleep(0.1)


def _dashboard(server) -> tuple[float, float]:
    m = httpx.get(server.url + "/dashboard/snapshot", timeout=30).json()["metrics"]
    return m["prompt_tokens"], m["generation_tokens"]


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _stream_usage(server, path: str, body: dict) -> dict:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    last = None
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    last = chunk["usage"]
    return last


def _stop_string(server) -> str:
    """Three characters from the middle of a greedy completion: the same request with them as a stop ends there."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Stop here", "max_tokens": 24, "ignore_eos": True,
                                                         "temperature": 0}, timeout=120).json()
    text = r["choices"][0]["text"]
    middle = len(text) // 2
    stop = text[middle:middle + 3]
    assert stop.strip()
    return stop


def test_usage_counters_and_dashboard_agree(server):
    stop = _stop_string(server)
    before = _counters(server)
    assert _dashboard(server) == before
    loads = [
        lambda: [_post(server, "/v1/completions", {"prompt": "Count me", "max_tokens": 12, "ignore_eos": True,
                                                  "n": 3, "temperature": 1.0, "seed": 7})],
        lambda: [_post(server, "/v1/completions", {"prompt": ["First prompt", "A second, longer prompt"],
                                                  "max_tokens": 9, "ignore_eos": True})],
        lambda: [_stream_usage(server, "/v1/completions", {"prompt": "Streamed", "max_tokens": 15,
                                                          "ignore_eos": True, "n": 2, "temperature": 1.0})],
        lambda: [_stream_usage(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Chat with me"}], "max_tokens": 11, "ignore_eos": True})],
        lambda: [_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Two replies"}],
                                                       "max_tokens": 8, "ignore_eos": True, "n": 2,
                                                       "temperature": 1.0})],
        lambda: [_post(server, "/v1/completions", {"prompt": "Stop here", "max_tokens": 24, "ignore_eos": True,
                                                  "temperature": 0, "stop": [stop]})],
    ]
    with ThreadPoolExecutor(len(loads)) as pool:
        usages = [u for f in [pool.submit(load) for load in loads] for u in f.result()]
    stopped = usages[-1]
    assert 0 < stopped["completion_tokens"] < 24  # the stop string ended it early
    after = _counters(server)
    assert after[0] - before[0] == sum(u["prompt_tokens"] for u in usages)
    assert after[1] - before[1] == sum(u["completion_tokens"] for u in usages)
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert _dashboard(server) == after


def test_an_aborted_stream_counts_what_it_was_sent(server):
    before = _counters(server)
    body = {"prompt": "Leave early", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the client leaves after its first chunk
    _wait_idle(server)
    # Whatever the engine had sent before the abort counts once; nothing counts after it.
    usage = _post(server, "/v1/completions", {"prompt": "After the abort", "max_tokens": 5, "ignore_eos": True})
    middle = _counters(server)
    later = _post(server, "/v1/completions", {"prompt": "And once more", "max_tokens": 6, "ignore_eos": True})
    after = _counters(server)
    assert after[0] - middle[0] == later["prompt_tokens"] and after[1] - middle[1] == later["completion_tokens"]
    aborted_generated = middle[1] - before[1] - usage["completion_tokens"]
    assert 1 <= aborted_generated < 200
    assert _dashboard(server) == after
