"""Admission: no single request can hold the engine. Its fan-out (prompts x n) and its list fields are capped
with a 400 before any work, a full waiting queue answers 429 with Retry-After, and sequences of different
API requests take turns in admission, so a small request is answered while a big one runs."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.server_utils import RemoteServer


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    srv = RemoteServer(path, "--served-model-name", "tiny", "--disable-log-stats", "--max-model-len", "512")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def small_queue_server(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    srv = RemoteServer(path, "--served-model-name", "tiny", "--disable-log-stats", "--max-model-len", "512",
                       "--max-num-seqs", "4", "--max-waiting-requests", "60")
    yield srv
    srv.stop()


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    return err


def _one_token(server, timeout: float) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=timeout,
                      json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1})


def test_the_125k_sequence_request_is_refused_and_others_are_answered(server):
    """The 4 KB request that queued 125k sequences at a34d16e (and kept a 1-token request waiting > 300 s)."""
    result = {}

    def big():
        result["r"] = httpx.post(server.url + "/v1/completions", timeout=120,
                                 json={"model": "tiny", "prompt": [[1]] * 1000, "n": 128, "max_tokens": 1})

    t = threading.Thread(target=big)
    t.start()
    small = _one_token(server, timeout=5)  # the acceptance bound on this 2-core machine
    t.join(120)
    assert small.status_code == 200, small.text
    err = _error(result["r"], 400, "n")
    assert "128000 sequences" in err["message"] and "--max-sequences-per-request" in err["message"]


def test_too_many_prompts_is_a_400_before_tokenizing(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": ["a"] * 10_000, "max_tokens": 1})
    assert "--max-prompts-per-request" in _error(r, 400, "prompt")["message"]


def test_a_big_request_within_the_caps_does_not_starve_a_small_one(small_queue_server):
    """32 sequences of 32 tokens through 4 running slots: 8 waves. The 1-token request sent once the big one
    streams is admitted at the next free slot (turns across API requests), so it is answered while at most
    a wave or two of the big request has finished; first-come-first-served would admit it after 28."""
    srv = small_queue_server
    finished = []
    streaming = threading.Event()

    def big():
        body = {"model": "tiny", "prompt": [[i + 1, 2, 3] for i in range(8)], "n": 4, "max_tokens": 32,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                streaming.set()
                if line.startswith("data: {"):
                    finished.extend(c for c in json.loads(line[6:])["choices"] if c.get("finish_reason"))

    t = threading.Thread(target=big)
    t.start()
    try:
        assert streaming.wait(120)
        small = _one_token(srv, timeout=120)
        done_before_small = len(finished)
        assert small.status_code == 200, small.text
    finally:
        t.join(600)
    assert len(finished) == 32
    assert done_before_small < 16, f"{done_before_small} of 32 big sequences finished before the small request"


def test_a_full_waiting_queue_is_a_429_with_retry_after(small_queue_server):
    srv = small_queue_server  # 4 running, 60 waiting
    body = {"model": "tiny", "prompt": [1, 2, 3], "n": 56, "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", srv.url + "/v1/completions", json=body) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)  # it runs: 4 sequences run, 52 wait
        r = client.post(srv.url + "/v1/completions", json={**body, "stream": False})
        err = _error(r, 429, None)
        assert r.headers["retry-after"] == "1" and "--max-waiting-requests 60" in err["message"]
        assert err["type"] == "RateLimitError"
        # Room for eight more waiting sequences: accepted.
        assert client.post(srv.url + "/v1/completions",
                           json={**body, "n": 8, "max_tokens": 1, "stream": False}).status_code == 200
    # The held stream is gone (its requests aborted): the queue has room again.
    assert httpx.post(srv.url + "/v1/completions", timeout=120,
                      json={**body, "max_tokens": 1, "stream": False}).status_code == 200


@pytest.mark.parametrize("field,value", [
    ("allowed_token_ids", [1] * 300_000),
    ("stop_token_ids", [1] * 5_000),
    ("bad_words", ["x"] * 5_000),
    ("logit_bias", {str(i % 64): 1.0 for i in range(20_000)} | {str(i): 1.0 for i in range(20_000)}),
    ("stop", ["s"] * 300),
])
def test_list_fields_are_capped(server, field, value):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1, "n": 4, field: value})
    if field == "logit_bias":  # token ids beyond the tiny vocabulary are refused first, also with a 400
        assert r.status_code == 400, r.text
        return
    assert "at most" in _error(r, 400, field if field != "stop" else "stop")["message"]


@pytest.mark.parametrize("request_id,fragment", [("x" * 10_000, "at most 256"), ("a\nb", "printable")])
def test_request_id_is_short_and_printable(server, request_id, fragment):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1, "request_id": request_id})
    assert fragment in _error(r, 400, "request_id")["message"]
