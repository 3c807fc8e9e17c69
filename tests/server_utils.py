"""Start `kvserve serve` as a subprocess on a free port, wait for /health, and always stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, model: str | None, *flags: str, api_key: str | None = None, startup_timeout: float = 300.0,
                 new_session: bool = False):
        """`new_session`: the server leads a process group of its own (with its children), so a test can
        signal the whole group as systemd and Kubernetes do."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve"]
        if model is not None:
            cmd.append(model)
        cmd += ["--port", str(self.port), "--uvicorn-log-level", "warning", *flags]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-server-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("KVSERVE_API_KEY", None)
        env.pop("VLLM_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=new_session)
        self.first_health_status: int | None = None  # what /health said first (503 while loading)
        self.first_health_body: bytes = b""
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                if self.first_health_status is None:
                    self.first_health_status, self.first_health_body = r.status_code, r.content
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-n:]

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai_client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=120, **kwargs)

    def async_openai_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                                  timeout=120, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels) -> value, from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, name: str) -> float:
        """The value of an unlabelled-but-for-model_name sample, e.g. 'kvserve:num_requests_running'."""
        for key, value in self.metrics().items():
            if key == name or key.startswith(name + "{"):
                return value
        raise KeyError(name)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def exit_code(self, timeout: float) -> int:
        """The server's exit status once it exits; past `timeout`, a failure that shows every thread's stack."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # the server dumps its threads' stacks to the log
            time.sleep(2)
            raise AssertionError(f"server still running {timeout:.0f} s after the signal:\n{self.log_tail(20000)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)


def stream_in_background(url: str, body: dict, timeout: float = 120) -> tuple[threading.Thread, list[str], threading.Event]:
    """POSTs a streaming request on a thread: (the thread, the `data: ` lines as they arrive, set at the first)."""
    lines: list[str] = []
    started = threading.Event()

    def stream():
        with httpx.stream("POST", url, json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    return thread, lines, started
