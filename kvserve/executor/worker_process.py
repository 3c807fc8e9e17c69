"""The main loop of a worker process (the `mp` executor): receive a message, act, reply.

Steps arrive as StepMessages (core/sched_output.py), which the worker's input batch applies. Only the output rank (TP rank 0
of the last pipeline stage) sends step results back, from a thread of its own: the main thread is then
free to receive and launch step N+1 while step N's sampled ids are still on their way to the host
(async scheduling keeps working across the process boundary).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import traceback


def _die_with_parent(rank: int) -> None:
    """Linux: this process gets SIGKILL when its parent (the engine) dies, however it dies: no orphans.
    It is also named kvserve-rankN in ps/top."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, f"kvserve-rank{rank}".encode()[:15])  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def run_worker_process(config, rank: int, local_rank: int, init_method: str, conn, output_rank: int,
                       parent_pid: int) -> None:
    _die_with_parent(rank)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    # The engine decides when workers stop (it joins them, and kills one that does not stop).
    from kvserve.child_signals import ignore_group_signals

    ignore_group_signals()
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s rank{rank} %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from kvserve import log_safety

    log_safety.install()
    send_lock = threading.Lock()

    def send(obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with send_lock:
            conn.send_bytes(data)

    try:
        from kvserve.gc_tuning import raise_young_generation_threshold
        from kvserve.worker.worker import Worker

        raise_young_generation_threshold()  # this process runs every step's worker half
        worker = Worker(config, rank, local_rank, init_method)
        worker.init_device()
        worker.load_model()
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which fails start-up with it
        logging.getLogger(__name__).exception("worker rank %d failed to start", rank)
        send(("error", f"worker rank {rank} failed to start: {type(e).__name__}: {e}"))
        os._exit(1)
    send(("ready", None))

    replies: queue.SimpleQueue = queue.SimpleQueue()

    def reply_loop() -> None:
        while (item := replies.get()) is not None:
            kind, value = item
            try:
                send(("ok", value.result() if kind == "pending" else value))
            except BaseException as e:  # noqa: BLE001
                _fail(send, rank, e)

    sender = threading.Thread(target=reply_loop, name=f"kvserve-worker{rank}-reply", daemon=True)
    sender.start()
    while True:
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the engine is gone
            break
        try:
            if kind == "execute":
                pending = worker.execute_model(payload)
                if rank == output_rank:
                    replies.put(("pending", pending))
            elif kind == "grammar":  # the mask of the step launched last: it samples now
                worker.sample_deferred(*payload)
            elif kind == "rpc":
                method, args = payload
                replies.put(("value", getattr(worker, method)(*args)))
            elif kind == "stop":
                break
        except BaseException as e:  # noqa: BLE001 - the engine fails the step and stops
            _fail(send, rank, e)
    replies.put(None)
    sender.join(10)
    os._exit(0)  # skip interpreter teardown: process groups of dead peers must not delay the exit


def _fail(send, rank: int, e: BaseException) -> None:
    logging.getLogger(__name__).error("worker rank %d failed:\n%s", rank, traceback.format_exc())
    try:
        send(("error", f"worker rank {rank} failed: {type(e).__name__}: {e}"))
    finally:
        os._exit(1)
