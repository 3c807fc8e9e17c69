"""Engine liveness (hardening finding 2): when the engine core process dies under the server, in-flight
requests fail with a 500 error (streams: an error event, then [DONE]), /health stops saying 200 and the
server exits non-zero, as vLLM does with its EngineDeadError; nothing ever claims "loading" again."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx

from tests.server_utils import RemoteServer

NUM_STREAMS = 10


def _engine_core_pid(server: RemoteServer) -> int:
    match = re.search(r"Engine core process started \(pid (\d+)\)", server.log_tail(200000))
    assert match, server.log_tail()
    return int(match.group(1))


def test_kill_engine_core_fails_streams_and_exits_nonzero(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    server = RemoteServer(path, "--served-model-name", "tiny", "--disable-log-stats")
    try:
        results: list[dict] = [{} for _ in range(NUM_STREAMS)]
        started = threading.Barrier(NUM_STREAMS + 1, timeout=120)

        def stream(i: int) -> None:
            body = {"model": "tiny", "prompt": f"Stream {i}", "max_tokens": 900, "ignore_eos": True, "stream": True}
            lines = []
            try:
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            if len(lines) == 2:
                                started.wait()
            except httpx.HTTPError as e:  # noqa: PERF203
                results[i]["transport_error"] = repr(e)
            results[i]["lines"] = lines
            results[i]["ended"] = time.monotonic()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        started.wait()
        os.kill(_engine_core_pid(server), signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)

        for r in results:
            assert "transport_error" not in r, r
            assert r["lines"][-1] == "data: [DONE]"
            error = json.loads(r["lines"][-2][6:])["error"]
            assert error["code"] == 500 and "engine" in error["message"].lower()
            assert r["ended"] - killed < 5  # bounded wait for a hang, not a speed claim

        # Until it exits, every answer is a 500 (never "loading"); then the port closes.
        statuses = []
        while server.proc.poll() is None:
            try:
                statuses.append(httpx.get(server.url + "/health", timeout=5).status_code)
                completion = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                                        timeout=5)
                assert completion.status_code == 500 and "loading" not in completion.text
            except httpx.TransportError:
                break
            time.sleep(0.05)
        assert all(s == 500 for s in statuses)
        assert server.proc.wait(timeout=30) != 0
        assert "died unexpectedly" in server.log_tail(200000)
    finally:
        server.stop()
