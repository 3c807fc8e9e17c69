"""`kvserve bench serve` end to end: against a stub OpenAI-compatible server that streams known tokens at
known times (first after 100 ms, then one every 20 ms), and against `kvserve serve` once it exists.

No wall-clock bounds here (a shared CI machine adds any amount of scheduling jitter): the timing
arithmetic, the role chunk that is not a first token included, is tested exactly on a scripted clock in
test_bench_metrics.py. Here the report must agree with the raw per-request data it came from, and
--max-concurrency is checked by what the stub saw in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from kvserve.entrypoints.cli import build_parser, main


class StubServer:
    """A minimal HTTP/1.1 server (asyncio, in a thread) speaking just enough of the OpenAI API:
    GET /v1/models, and streamed POST /v1/completions and /v1/chat/completions that emit max_tokens
    chunks "t0 ", "t1 ", ... on a fixed schedule from the moment the request arrived."""

    def __init__(self, first_s=0.1, gap_s=0.02, send_usage=True, model="stub-model"):
        self.first_s, self.gap_s, self.send_usage, self.model = first_s, gap_s, send_usage, model
        self.requests: list[dict] = []  # the JSON bodies received, for assertions
        self.in_flight = self.max_in_flight = 0  # streams open at once (all on the stub's own loop)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.port = None

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10), "stub server did not start"
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self):
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _handle(self, reader, writer):
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _one_request(self, reader, writer) -> bool:
        request_line = await reader.readline()
        if not request_line:
            return False
        arrived = time.perf_counter()
        method, path, _ = request_line.decode().split(" ", 2)
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, value = line.decode().split(":", 1)
            headers[key.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        if method == "GET" and path == "/v1/models":
            self._send_json(writer, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
            await writer.drain()
            return True
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            self._send_json(writer, {"error": {"message": f"no route {path}"}}, status="404 Not Found")
            await writer.drain()
            return True
        payload = json.loads(body)
        self.requests.append(payload)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._stream(writer, payload, chat=path.endswith("chat/completions"), arrived=arrived)
        finally:
            self.in_flight -= 1
        return True

    def _send_json(self, writer, obj, status="200 OK"):
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                     .encode() + data)

    async def _stream(self, writer, payload, chat: bool, arrived: float):
        def event(obj):  # one SSE event as one HTTP chunk
            data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        if chat:  # role announcement with no content, before any token, as real servers do
            event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await writer.drain()
        n = payload.get("max_completion_tokens") or payload.get("max_tokens") or 16
        for i in range(n):
            # Due times from the arrival, so sleep overshoot does not accumulate across tokens.
            await asyncio.sleep(max(0.0, arrived + self.first_s + i * self.gap_s - time.perf_counter()))
            text = f"t{i} "
            event({"choices": [{"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}]})
            await writer.drain()
        event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        prompt = payload.get("prompt") if not chat else payload["messages"][-1]["content"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        if self.send_usage and (payload.get("stream_options") or {}).get("include_usage"):
            event({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                            "total_tokens": prompt_tokens + n}})
        event("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def _bench(capsys, *args) -> tuple[int, str]:
    rc = main(["bench", "serve", *args, "--disable-tqdm"])
    return rc, capsys.readouterr().out


def _value(out: str, label: str) -> float:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return float(line[len(label):].strip())


def test_stub_server_completions_token_ids(capsys, tmp_path):
    n, out_len, in_len = 6, 8, 12
    with StubServer() as stub:
        rc, out = _bench(capsys, "--base-url", stub.url, "--dataset", "random", "--num-prompts", str(n),
                         "--input-len", str(in_len), "--output-len", str(out_len), "--max-concurrency", "3",
                         "--output-json", str(tmp_path / "r.json"))
        bodies = stub.requests
    assert rc == 0, out
    assert "{:=^50}".format(" Serving Benchmark Result ") in out
    assert _value(out, "Successful requests:") == n and _value(out, "Failed requests:") == 0
    assert _value(out, "Total input tokens:") == n * in_len
    assert _value(out, "Total generated tokens:") == n * out_len  # = what the stub streamed
    # The model came from /v1/models; prompts went as token arrays with the vLLM length pins.
    main_bodies = bodies[1:]  # the first is the initial test request
    assert len(main_bodies) == n
    assert all(b["model"] == "stub-model" and isinstance(b["prompt"], list) and len(b["prompt"]) == in_len
               and b["max_tokens"] == out_len and b["ignore_eos"] and b["min_tokens"] == out_len for b in main_bodies)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == n and result["total_output_tokens"] == n * out_len
    assert result["output_lens"] == [out_len] * n and len(result["ttfts"]) == n
    assert all(len(itl) == out_len - 1 for itl in result["itls"])
    duration = result["duration"]
    assert result["output_throughput"] == pytest.approx(n * out_len / duration)
    # The printed report is the raw data's statistics (to its 2 decimals), whatever the machine's timing.
    ttfts_ms = sorted(1000 * t for t in result["ttfts"])
    assert _value(out, "Median TTFT (ms):") == pytest.approx((ttfts_ms[2] + ttfts_ms[3]) / 2, abs=0.006)
    itls_ms = [1000 * g for itl in result["itls"] for g in itl]
    assert _value(out, "Mean ITL (ms):") == pytest.approx(sum(itls_ms) / len(itls_ms), abs=0.006)
    e2el_ms = [1000 * (t + sum(itl)) for t, itl in zip(result["ttfts"], result["itls"])]  # last chunk = end
    assert _value(out, "Mean E2EL (ms):") == pytest.approx(sum(e2el_ms) / n, abs=0.006)
    assert _value(out, "Mean TPOT (ms):") == pytest.approx(
        sum((e - 1000 * t) / (out_len - 1) for e, t in zip(e2el_ms, result["ttfts"])) / n, abs=0.006)
    # --max-concurrency 3: never more than 3 streams open, and the cap was reached.
    assert stub.max_in_flight == 3


def test_stub_server_chat_without_usage_and_plot(capsys, tmp_path, smol_tokenizer):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "serve.png"
    with StubServer(send_usage=False) as stub:
        # An OpenAI-SDK-style base URL (ending in /v1) works too.
        rc, out = _bench(capsys, "--base-url", stub.url + "/v1", "--endpoint", "/v1/chat/completions",
                         "--model", "stub-model",
                         "--dataset", "random", "--num-prompts", "4", "--input-len", "8", "--output-len", "5",
                         "--request-rate", "20", "--plot", str(plot))
    assert rc == 0, out
    assert _value(out, "Successful requests:") == 4
    # No usage: tokens are counted by tokenizing the streamed text with the (default SmolLM2) tokenizer.
    per_request = len(smol_tokenizer.encode("t0 t1 t2 t3 t4 ", add_special_tokens=False))
    assert _value(out, "Total generated tokens:") == 4 * per_request
    assert _value(out, "Median TTFT (ms):") <= _value(out, "Median E2EL (ms):")
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_server_fails_clearly(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed after the block: nothing listens there
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--dataset", "w1",
               "--num-prompts", "1", "--disable-tqdm"])
    err = capsys.readouterr().err
    assert rc == 2 and "Initial test run failed" in err and "ConnectError" in err


def _has_serve_command() -> bool:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return "serve" in sub.choices


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not _has_serve_command(), reason="`kvserve serve` (the OpenAI server) is not in this tree yet")
def test_against_kvserve_serve(capsys, tmp_path):
    port = _free_port()
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port),
                                   "--max-model-len", "512"], stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
                assert time.time() < deadline, "kvserve serve did not become ready"
                time.sleep(1)
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            rc, out = _bench(capsys, "--base-url", f"http://127.0.0.1:{port}", "--endpoint", endpoint,
                             "--dataset", "random", "--num-prompts", "3", "--input-len", "16", "--output-len", "6",
                             "--output-json", str(tmp_path / "r.json"))
            assert rc == 0, out
            result = json.loads((tmp_path / "r.json").read_text())
            assert result["completed"] == 3 and result["failed"] == 0
            assert result["output_lens"] == [6, 6, 6]  # ignore_eos + max_tokens: exactly what was asked
            if endpoint == "/v1/completions":
                assert result["input_lens"] == [16, 16, 16]  # token ids sent as they are
            e2el, ttft, tpot = result["mean_e2el_ms"], result["mean_ttft_ms"], result["mean_tpot_ms"]
            assert ttft <= e2el and tpot == pytest.approx((e2el - ttft) / 5, rel=0.05)
    finally:
        server.terminate()
        server.wait(30)
