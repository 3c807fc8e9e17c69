"""120 concurrent streams, 30% (36) dropped mid-stream: the dropped requests are aborted, every kept stream
ends with [DONE] and, once they finish, nothing runs and no KV block is held (as /metrics reports)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server_utils import RemoteServer

NUM_STREAMS = 120
NUM_DROPPED = 36
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    srv = RemoteServer(path, "--served-model-name", "tiny", "--disable-log-stats")
    yield srv
    srv.stop()


async def _one_stream(client: httpx.AsyncClient, i: int, drop: bool) -> tuple[int, bool]:
    """Returns (chunks read, whether it saw [DONE])."""
    body = {"model": "tiny", "prompt": f"Request number {i} says", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True}
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks, True
            assert "error" not in json.loads(line[6:])
            chunks += 1
            if drop and chunks == 2:
                return chunks, False  # leaving the block closes the connection mid-stream
    return chunks, False


async def _run_streams(url: str):
    limits = httpx.Limits(max_connections=NUM_STREAMS + 5)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        return await asyncio.gather(*(_one_stream(client, i, i < NUM_DROPPED) for i in range(NUM_STREAMS)))


def _poll(server, predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if predicate(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


def _value(metrics: dict, name: str, **labels) -> float:
    for key, value in metrics.items():
        if key.startswith(name + "{") and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    return 0.0


def test_dropped_streams_free_their_blocks(server):
    results = asyncio.run(_run_streams(server.url))
    dropped, completed = results[:NUM_DROPPED], results[NUM_DROPPED:]
    assert all(chunks == 2 and not done for chunks, done in dropped)
    assert all(done for _, done in completed)

    m = _poll(server, lambda m: _value(m, "kvserve:num_requests_running") == 0
              and _value(m, "kvserve:kv_cache_usage_perc") == 0
              and _value(m, "kvserve:request_success_total", finished_reason="abort") >= NUM_DROPPED)
    assert _value(m, "kvserve:num_requests_running") == 0
    assert _value(m, "kvserve:num_requests_waiting") == 0
    assert _value(m, "kvserve:kv_cache_usage_perc") == 0
    assert _value(m, "kvserve:request_success_total", finished_reason="abort") == NUM_DROPPED
    assert _value(m, "kvserve:request_success_total", finished_reason="length") == NUM_STREAMS - NUM_DROPPED
    # The dropped requests stopped early: fewer than NUM_STREAMS * MAX_TOKENS tokens were generated.
    assert _value(m, "kvserve:generation_tokens_total") < NUM_STREAMS * MAX_TOKENS
    assert httpx.get(server.url + "/health").status_code == 200


def test_non_streaming_client_that_leaves_is_aborted(server):
    body = {"model": "tiny", "prompt": "A long one", "max_tokens": 900, "ignore_eos": True}
    before = _value(server.metrics(), "kvserve:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    m = _poll(server, lambda m: _value(m, "kvserve:request_success_total", finished_reason="abort") > before
              and _value(m, "kvserve:num_requests_running") == 0)
    assert _value(m, "kvserve:request_success_total", finished_reason="abort") == before + 1
    assert _value(m, "kvserve:kv_cache_usage_perc") == 0
