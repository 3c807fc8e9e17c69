"""`mp`: one worker process per rank on this host (spawned, never forked), driven over pipes.

Each step is pickled once and written to every worker (a broadcast of a StepMessage: a small diff, see
core/sched_output.py); the result comes back from the output rank only. While waiting for anything, the
executor also watches every worker process: one that exits or reports an error fails the wait at once
with ExecutorDeadError naming the rank, so a dead worker never leaves the engine hanging.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import socket
import sys
import time

from kvserve.executor.abstract import Executor, ExecutorDeadError

logger = logging.getLogger(__name__)

# Start-up (spawn + import torch + load the shard) is bounded: a worker that neither reports ready nor
# fails within this time fails the engine's start with its rank named.
STARTUP_TIMEOUT_S = float(os.environ.get("KVSERVE_WORKER_STARTUP_TIMEOUT", "600"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BroadcastStats:
    """Bytes and seconds spent writing step messages to the workers (pickle + one write per worker)."""

    def __init__(self):
        self.steps = 0
        self.bytes = 0
        self.seconds = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.steps += 1
        self.bytes += nbytes
        self.seconds += seconds

    def summary(self) -> dict:
        n = max(self.steps, 1)
        return dict(steps=self.steps, bytes_per_step=self.bytes / n, seconds_per_step=self.seconds / n)


class _PendingStep:
    def __init__(self, executor: MultiprocExecutor, seq: int):
        self.executor, self.seq = executor, seq
        self._value = None

    def result(self):
        if self._value is None:
            self._value = self.executor._step_result(self.seq)
        return self._value


class MultiprocExecutor(Executor):
    def __init__(self, config):
        super().__init__(config)
        args = config.args
        self.world_size = args.world_size
        self.output_rank = self.world_size - args.tensor_parallel_size  # TP rank 0 of the last stage
        self.broadcast = BroadcastStats()
        self._inbox = [collections.deque() for _ in range(self.world_size)]
        self._next_seq = 0
        self._results: dict[int, object] = {}
        self._next_result = 0
        self._dead: str | None = None
        self._start_workers()
        # Also at interpreter exit (and in a daemonic engine process, whose exit runs these finalizers).
        self._finalizer = multiprocessing.util.Finalize(self, _stop_workers, args=(self.procs, self.conns),
                                                        exitpriority=10)
        try:
            self._collect(range(self.world_size), "ready", time.monotonic() + STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        from kvserve.executor.worker_process import run_worker_process

        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs, self.conns = [], []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_worker_process, name=f"kvserve-worker-{rank}", daemon=True,
                               args=(self.config, rank, rank, init_method, child, self.output_rank, os.getpid()))
            _start(proc)
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        logger.info("Started %d worker processes (pids %s)", self.world_size, [p.pid for p in self.procs])

    # ---- receiving, with every worker watched -----------------------------------------------------
    def _fail(self, message: str):
        self._dead = self._dead or message
        raise ExecutorDeadError(self._dead)

    def _recv(self, rank: int, deadline: float | None = None):
        """The next reply of `rank`; raises ExecutorDeadError as soon as any worker dies or fails."""
        if self._dead:
            raise ExecutorDeadError(self._dead)
        while not self._inbox[rank]:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait(self.conns + [p.sentinel for p in self.procs], timeout)
            if not ready:
                self._fail(f"worker rank {rank} did not reply within the time allowed")
            for r, conn in enumerate(self.conns):
                if conn in ready:
                    try:
                        msg = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        continue  # its sentinel says why
                    if msg[0] == "error":
                        self._fail(msg[1])
                    self._inbox[r].append(msg)
            if not self._inbox[rank]:
                for r, proc in enumerate(self.procs):
                    if proc.sentinel in ready:
                        proc.join(1)
                        self._fail(f"worker rank {r} (pid {proc.pid}) died unexpectedly (exit code {proc.exitcode})")
        return self._inbox[rank].popleft()[1]

    def _collect(self, ranks, what: str, deadline: float | None = None) -> list:
        return [self._recv(r, deadline) for r in ranks]

    # ---- Executor -------------------------------------------------------------------------------
    def _broadcast(self, obj) -> int:
        if self._dead:
            raise ExecutorDeadError(self._dead)
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                self._fail(f"worker rank {rank} (pid {self.procs[rank].pid}) is gone (exit code {self.procs[rank].exitcode})")
        return len(data)

    def collective_rpc(self, method: str, *args) -> list:
        self._broadcast(("rpc", (method, args)))
        return self._collect(range(self.world_size), method)

    def execute_async(self, sched_out):
        t0 = time.perf_counter()
        nbytes = self._broadcast(("execute", sched_out.message))
        self.broadcast.add(nbytes, time.perf_counter() - t0)
        if self.broadcast.steps % 5000 == 0:
            b = self.broadcast.summary()
            logger.info("Step broadcast to %d workers: %.0f bytes/step, %.3f ms/step (over %d steps)",
                        self.world_size, b["bytes_per_step"], 1000 * b["seconds_per_step"], b["steps"])
        seq = self._next_seq
        self._next_seq += 1
        return _PendingStep(self, seq)

    defers_grammar_bitmask = True

    def send_grammar_bitmask(self, bitmask, mask_row: dict[str, int]) -> None:
        # Every rank samples (and keeps its sampled ids for the next step's placeholders).
        self._broadcast(("grammar", (bitmask, mask_row)))

    def _step_result(self, seq: int):
        while seq not in self._results:  # results arrive in launch order
            self._results[self._next_result] = self._recv(self.output_rank)
            self._next_result += 1
        return self._results.pop(seq)

    def check_health(self) -> None:
        if self._dead:
            raise ExecutorDeadError(self._dead)
        for r, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._fail(f"worker rank {r} (pid {proc.pid}) died unexpectedly (exit code {proc.exitcode})")

    def shutdown(self) -> None:
        self._finalizer()  # runs once


def _start(proc) -> None:
    """Starts a spawned worker that needs nothing from the caller's __main__: a script that builds an LLM
    without an `if __name__ == "__main__":` guard must not be re-run by every worker. And the engine may
    itself run in a daemonic process, which multiprocessing forbids children: these are ours to reap
    (shutdown, the exit finalizer, and PDEATHSIG in the worker)."""
    me = multiprocessing.current_process()
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    was_daemon = me._config.get("daemon")
    me._config["daemon"] = False
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        proc.start()
    finally:
        me._config["daemon"] = was_daemon
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__


def _stop_workers(procs, conns) -> None:
    """Asks each worker to stop, then terminates and kills what is still there: no process is left."""
    data = pickle.dumps(("stop", None))
    for conn in conns:
        try:
            conn.send_bytes(data)
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join(2)
    for conn in conns:
        conn.close()
