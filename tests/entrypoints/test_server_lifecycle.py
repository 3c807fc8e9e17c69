"""`kvserve serve` as a process: vLLM's command line, 503 while loading, SIGTERM drains and exits 0; and the
CLI's own checks (help groups, bad flags) without starting anything."""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvserve.entrypoints.cli import build_parser, main
from tests.server_utils import RemoteServer, stream_in_background


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    # The flags of a typical `vllm serve` command line.
    srv = RemoteServer(path, "--max-model-len", "512", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "8",
                       "--block-size", "16", "--enable-prefix-caching", "--dtype", "float32", "--seed", "0")
    yield srv
    srv.stop()


def test_vllm_command_line_and_startup(server, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert models[0]["id"] == path and models[0]["max_model_len"] == 512
    # While the model loaded, /health said 503 (as OpenAI JSON), unless loading beat the first probe.
    assert server.first_health_status in (200, 503)
    if server.first_health_status == 503:
        assert json.loads(server.first_health_body)["error"]["code"] == 503


def test_engine_config_resolved_once_per_serve(server):
    """The process that parsed the command line resolves the config; the engine process is handed it."""
    log = server.log_tail(10 ** 7)
    assert "Engine ready in" in log  # the engine process's own log lines reach this log
    resolutions = re.findall(r"Engine config resolved \(pid (\d+)\)", log)
    assert resolutions == [str(server.proc.pid)]


def test_sigusr1_writes_every_threads_stack_and_serving_goes_on(server):
    """Dumps taken while the server's threads are busy (a request being served, the grammar libraries
    loading after start-up) must leave it serving."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(httpx.post, server.url + "/v1/completions",
                           json={"prompt": "Hi", "max_tokens": 16}, timeout=60)
        for _ in range(5):
            server.signal(signal.SIGUSR1)
            time.sleep(0.05)
        assert busy.result().status_code == 200
    # Signals that come before the main thread gets to run the handler are one (the kernel and Python
    # coalesce them), and one that comes during a dump is answered by it: at least one dump, whole.
    for _ in range(50):
        if "(MainThread)" in server.log_tail(10 ** 7):
            break
        time.sleep(0.1)
    log = server.log_tail(10 ** 7)
    assert log.count("Current thread 0x") >= 1 and "(MainThread)" in log and "api_server.py" in log
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_sigterm_lets_streams_finish_then_exits_zero(server):
    body = {"prompt": "Drain me", "max_tokens": 60, "ignore_eos": True, "stream": True}
    t, lines, started = stream_in_background(server.url + "/v1/completions", body)
    assert started.wait(60)
    server.signal(signal.SIGTERM)
    t.join(120)
    assert server.exit_code(timeout=120) == 0
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the stream ran to its end
    assert "Engine stopped" in server.log_tail(20000)


def test_serve_help_groups_engine_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for group in ("Server options", "Model options", "Cache options", "Scheduler options"):
        assert group in out
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--uvicorn-log-level", "--max-model-len",
                 "--gpu-memory-utilization", "--enable-prefix-caching", "--max-num-seqs"):
        assert flag in out


def test_serve_defaults():
    ns = build_parser().parse_args(["serve"])
    assert (ns.host, ns.port, ns.model_tag, ns.model) == ("127.0.0.1", 8000, None, None)


def test_bad_engine_flag_fails_before_serving(capsys):
    assert main(["serve", "--block-size", "3"]) == 2
    assert "--block-size" in capsys.readouterr().err


def test_bad_flag_in_subprocess_exits_nonzero():
    r = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--max-num-seqs", "0"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--max-num-seqs" in r.stderr


def test_remote_server_helper_reports_startup_failure(tmp_path):
    with pytest.raises(RuntimeError, match="exited"):
        RemoteServer(str(tmp_path / "missing-model"), startup_timeout=60)
