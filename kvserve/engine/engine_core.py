"""EngineCore: the step loop that serves an AsyncEngine, apart from how commands reach it and results leave.

Between steps it applies the commands that arrived (add, abort, stop); then it runs one step and publishes
one EngineBatch: which adds were accepted (or why not), the step's outputs, the requests a failed step
aborted, and the engine's stats. It blocks for commands only while it has nothing to run.

It runs either on a thread of the server process or, by default, in a process of its own
(`run_engine_core_process`), as vLLM's EngineCore does: there its Python work (scheduling, input
building, detokenization) never waits for the server's GIL, and HTTP work never waits for a step.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvserve import log_safety
from kvserve.child_signals import ignore_group_signals
from kvserve.executor.abstract import ExecutorDeadError
from kvserve.engine.step_errors import StepOutOfMemoryError
from kvserve.engine.kv_snapshot import SnapshotSampler
from kvserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Commands are plain tuples, so they pickle cheaply: ("add", id, prompt, params, group) | ("abort", id) | ("stop",)
# | ("ping",), which only makes an idle core publish a batch: the server's proof that the step loop lives.
STOP = ("stop",)
PING = ("ping",)


@dataclass
class EngineBatch:
    accepted: list  # [(request_id, exception or None)]
    outputs: list[RequestOutput]
    failed: list[str]  # requests aborted because the step failed
    stats: object  # EngineStats
    failed_reason: str | None = None  # why they failed, for the client (None: see the server log)
    kv_snapshot: dict | None = None  # for /dashboard, at most every 0.5 s (kv_snapshot.py)


class EngineCore:
    def __init__(self, engine):
        self.engine = engine
        self.live: set[str] = set()  # request ids the engine holds
        self.snapshots = SnapshotSampler()

    def run(self, take_commands: Callable[[bool], list], publish: Callable[[EngineBatch], None]) -> None:
        """`take_commands(block)` returns the commands that arrived (waiting for one if block); returns on stop."""
        engine = self.engine
        # The empty engine's picture, so /dashboard has one before the first request.
        publish(EngineBatch([], [], [], engine.get_stats(), kv_snapshot=self.snapshots.maybe_take(engine)))
        while True:
            accepted = []
            for cmd in take_commands(not engine.has_unfinished_requests()):
                kind = cmd[0]
                if kind == "add":
                    _, rid, prompt, params, group = cmd
                    try:
                        engine.add_request(rid, prompt, params, group)
                        self.live.add(rid)
                        accepted.append((rid, None))
                    except Exception as e:  # noqa: BLE001 - a bad request is the caller's error, not ours
                        accepted.append((rid, _portable(e)))
                elif kind == "abort":
                    if cmd[1] in self.live:
                        self.live.discard(cmd[1])
                        engine.abort_request([cmd[1]])
                elif kind == "stop":
                    engine.abort_request(list(self.live))
                    return
                # "ping": nothing to do; the batch published below is the answer
            outputs: list[RequestOutput] = []
            failed: list[str] = []
            failed_reason = None
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except StepOutOfMemoryError as e:  # the engine already aborted the step's requests; the rest go on
                    failed = [rid for rid in e.request_ids if rid in self.live]
                    self.live.difference_update(failed)
                    failed_reason = str(e)
                except Exception as e:
                    logger.exception("Engine step failed")
                    if isinstance(e, ExecutorDeadError):  # no step can run any more: fail them all, then exit
                        failed = list(self.live)
                        engine.abort_request(failed)
                        self.live.clear()
                        publish(EngineBatch(accepted, [], failed, engine.get_stats()))
                        raise
                    failed = self._recover(engine)  # the requests to blame fail; the others recompute
            for out in outputs:
                if out.finished:
                    self.live.discard(out.request_id)
            publish(EngineBatch(accepted, outputs, failed, engine.get_stats(), failed_reason,
                                kv_snapshot=self.snapshots.maybe_take(engine)))

    def _recover(self, engine) -> list[str]:
        try:
            failed = [rid for rid in engine.recover_from_failed_step() if rid in self.live]
        except Exception:  # noqa: BLE001 - recovery itself failed: fall back to aborting everything
            logger.exception("Could not attribute the failed step; aborting the %d requests in flight",
                             len(self.live))
            failed = list(self.live)
            engine.abort_request(failed)
        logger.error("Aborted %d request(s) after the failed step: %s", len(failed), failed[:10])
        self.live.difference_update(failed)
        return failed


def _portable(e: Exception) -> Exception:
    """The same error as a built-in type, which pickles and unpickles whatever its class's __init__ needs:
    ValueError (the request is invalid: a 400) stays one, anything else is the engine's fault (a 500)."""
    if isinstance(e, ValueError):
        return ValueError(str(e))
    return RuntimeError(f"{type(e).__name__}: {e}")


def run_engine_core_process(config, conn) -> None:
    """Entry point of the engine process, handed the EngineConfig its parent resolved: load, report
    ("ready", None) or ("error", message), then serve commands arriving on `conn` until "stop" or until the
    server's end of the pipe closes."""
    ignore_group_signals()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    log_safety.install()
    try:
        from kvserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
    except BaseException as e:  # reported to the server, which exits
        logger.exception("Engine failed to start")
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))

    def take_commands(block: bool) -> list:
        commands = []
        try:
            if block:
                conn.poll(None)
            while conn.poll(0):
                commands.extend(conn.recv())
        except (EOFError, OSError):  # the server is gone
            commands.append(STOP)
        return commands

    outbox = ProcessOutbox(conn)
    try:
        EngineCore(engine).run(take_commands, outbox.publish)
    finally:
        outbox.close()


class ProcessOutbox:
    """Sends each step's EngineBatch to the server without ever making the step loop wait for it.

    The batch is pickled here, on the step loop's thread (a consistent snapshot: the next step mutates the
    objects it came from), and written by a thread of its own: a full pipe (the server busy with HTTP
    work) then delays the server's view of the outputs, never the next step on the GPU. Outputs leave
    without their prompt and prompt token ids: the server sent them, it puts them back (hundreds of ids
    per request per step would otherwise dominate the message)."""

    def __init__(self, conn):
        self.conn = conn
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._send_loop, name="kvserve-engine-outbox", daemon=True)
        self.thread.start()

    def publish(self, batch: EngineBatch) -> None:
        for out in batch.outputs:
            out.prompt = None
            out.prompt_token_ids = None
        self.queue.put(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_loop(self) -> None:
        while (data := self.queue.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except (BrokenPipeError, OSError):  # the server went away
                return

    def close(self) -> None:
        """Flushes what is queued (the last outputs, then the pipe closes)."""
        self.queue.put(None)
        self.thread.join(10)
