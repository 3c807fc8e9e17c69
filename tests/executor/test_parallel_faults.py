"""Faults and shutdown with worker processes: a worker killed mid-generation fails the requests with an
error naming it (never a hang); `kvserve serve -tp 2` exits 0 on SIGTERM and leaves no process behind,
and exits 1 (with /health failing) when one of its workers dies."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.executor.abstract import ExecutorDeadError
from tests.server_utils import RemoteServer

# Bounds for hangs only (a test must never hang); the checks do not depend on them being tight.
HANG_BOUND_S = 60


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("llama")[0]  # 4 heads, 2 KV heads: tp=2 splits both


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, bound=HANG_BOUND_S) -> set[int]:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return {p for p in pids if _alive(p)}


def test_killed_worker_fails_the_step_with_its_rank(tiny):
    engine = LLMEngine(EngineArgs(model=tiny, tensor_parallel_size=2, max_model_len=256,
                                  kv_cache_memory_bytes=16 << 20))
    try:
        engine.add_request("a", {"prompt_token_ids": list(range(5, 25))},
                           SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
        for _ in range(3):
            engine.step()
        victim = engine.executor.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        error: list[BaseException] = []

        def run():
            try:
                while engine.has_unfinished_requests():
                    engine.step()
            except BaseException as e:  # noqa: BLE001
                error.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(HANG_BOUND_S)
        assert not t.is_alive(), "the engine hung after a worker died"
        assert error and isinstance(error[0], ExecutorDeadError)
        assert "worker rank 1" in str(error[0]) and str(victim.pid) in str(error[0])
        with pytest.raises(ExecutorDeadError):  # every later step fails the same way
            engine.step()
    finally:
        engine.shutdown()
    assert not _wait_gone([p.pid for p in engine.executor.procs])


def test_serve_tp2_sigterm_exits_0_without_orphans(tiny):
    server = RemoteServer(tiny, "-tp", "2", "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20))
    try:
        tree = _descendants(server.proc.pid)
        assert len(tree) >= 3  # the engine process and two workers (plus multiprocessing helpers)
        r = httpx.post(server.url + "/v1/completions", json={"model": tiny, "prompt": [5, 6, 7], "max_tokens": 4},
                       timeout=HANG_BOUND_S)
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) >= 0
        server.signal(signal.SIGTERM)
        assert server.proc.wait(timeout=HANG_BOUND_S) == 0
        assert not _wait_gone(tree)
    finally:
        server.stop()


def test_serve_exits_1_when_a_worker_dies(tiny):
    server = RemoteServer(tiny, "-tp", "2", "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20))
    try:
        tree = _descendants(server.proc.pid)
        workers = [p for p in tree if _comm(p).startswith("kvserve-rank")]
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        # The next request fails with an error (it never hangs), then the server exits 1.
        try:
            r = httpx.post(server.url + "/v1/completions", json={"model": tiny, "prompt": [5, 6, 7], "max_tokens": 50},
                           timeout=HANG_BOUND_S)
            assert r.status_code >= 500
        except httpx.TransportError:
            pass  # the server was already on its way out
        assert server.proc.wait(timeout=HANG_BOUND_S) == 1
        assert not _wait_gone(tree)
    finally:
        server.stop()


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
