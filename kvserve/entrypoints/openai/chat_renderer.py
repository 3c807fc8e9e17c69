"""Chat templates rendered in a child process, with a time, memory and output-size limit.

A jinja2 template is a program: the sandbox keeps it away from Python's internals, but not from looping
for ever (`{% for a in range(99999) %}{% for b in range(99999) %}`) or from building a huge string
(`'x' * 200000000`), and jinja offers no step counter that catches both. So the template runs where it
can be stopped: a worker process under an address-space limit, which is killed (and replaced) when a
render takes longer than its time limit. The event loop only waits on a pipe, from a thread.

Several workers (DEFAULT_WORKERS, bounded by the CPU count) render at once, so one heavy template delays
only the requests queued behind every worker, not every chat.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.util
import os
import pickle
import queue
import resource
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))
DEFAULT_MAX_OUTPUT_CHARS = 4_000_000
# Address space the worker may add to what it uses once the tokenizer is loaded.
_MEMORY_HEADROOM_BYTES = 1 << 30


class ChatTemplateError(ValueError):
    """The template refused these messages, ran too long, or produced too much (the client's error: 400)."""


class ChatTemplateTimeout(ChatTemplateError):
    """The render ran past the time limit (its worker was killed and replaced)."""


def _worker_main(conn, tokenizer_bytes: bytes, max_output_chars: int) -> None:
    from kvserve.child_signals import ignore_group_signals

    ignore_group_signals()  # the server decides when its workers stop
    tokenizer = pickle.loads(tokenizer_bytes)
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + _MEMORY_HEADROOM_BYTES, hard))
    except (OSError, ValueError):  # no /proc or no permission: the time limit still holds
        pass
    conn.send(("ready", None))
    while True:
        try:
            messages, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
            if len(text) > max_output_chars:
                reply = ("error", f"the rendered prompt has {len(text)} characters, more than the limit of "
                                  f"{max_output_chars}")
            else:
                reply = ("ok", text)
        except MemoryError:
            reply = ("error", "rendering the template needed more memory than allowed")
        except Exception as e:  # noqa: BLE001 - a template refusing the messages is the client's error
            reply = ("error", f"{type(e).__name__}: {e}"[:2000])
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


class _Worker:
    def __init__(self, tokenizer_bytes: bytes, max_output_chars: int):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, tokenizer_bytes, max_output_chars),
                                   name="kvserve-chat-template", daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        # It ignores SIGTERM: reaped here at exit, before multiprocessing's handler would wait on it.
        multiprocessing.util.Finalize(self, _kill, args=(self.process,), exitpriority=10)

    def wait_ready(self, timeout: float) -> None:
        if not self.ready:
            if not self.conn.poll(timeout):
                raise TimeoutError("the chat template worker did not start")
            self.conn.recv()
            self.ready = True

    def call(self, messages, kwargs, timeout: float):
        self.conn.send((messages, kwargs))
        if not self.conn.poll(timeout):
            return None
        return self.conn.recv()

    def kill(self) -> None:
        _kill(self.process)
        self.conn.close()


def _kill(process) -> None:
    if process.is_alive():
        process.kill()
    process.join(5)


class ChatTemplateRenderer:
    """`await render(messages, **apply_chat_template_kwargs)` -> the prompt text, or ChatTemplateError;
    `render_sync` is the same for callers without an event loop (`LLM.chat`)."""

    def __init__(self, tokenizer, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS, startup_timeout_s: float = 300.0,
                 num_workers: int = DEFAULT_WORKERS):
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.startup_timeout_s = startup_timeout_s
        self._tokenizer_bytes = pickle.dumps(tokenizer)
        # Idle workers; a render takes one (waiting on its pool thread if all are busy) and gives it back.
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._all: list[_Worker] = []
        for _ in range(num_workers):
            self._idle.put(self._start_worker())
        self._closed = False
        self._threads = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="kvserve-chat-template")

    def _start_worker(self) -> _Worker:
        worker = _Worker(self._tokenizer_bytes, self.max_output_chars)
        self._all.append(worker)
        return worker

    async def render(self, messages: list[dict], **kwargs) -> str:
        loop = asyncio.get_running_loop()
        return _text_or_raise(*await loop.run_in_executor(self._threads, self._render_blocking, messages, kwargs))

    def render_sync(self, messages: list[dict], **kwargs) -> str:
        return _text_or_raise(*self._render_blocking(messages, kwargs))

    def _render_blocking(self, messages, kwargs):
        worker = self._idle.get()
        if self._closed:
            self._idle.put(worker)
            return ("error", "the server is shutting down")
        try:
            worker.wait_ready(self.startup_timeout_s)
            reply = worker.call(messages, kwargs, self.timeout_s)
        except (EOFError, OSError, TimeoutError) as e:
            worker = self._replace(worker)
            return ("error", f"the chat template worker failed ({type(e).__name__}); it was restarted")
        else:
            if reply is None:
                logger.warning("A chat template render took longer than %.1f s; restarting its worker.",
                               self.timeout_s)
                worker = self._replace(worker)
                return ("timeout", f"rendering the chat template took longer than {self.timeout_s:g} s")
            return reply
        finally:
            self._idle.put(worker)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        if self._closed:
            return worker
        self._all.remove(worker)
        return self._start_worker()

    def close(self) -> None:
        self._closed = True
        for worker in list(self._all):
            worker.kill()
        self._threads.shutdown(wait=False)


def _text_or_raise(status: str, value: str) -> str:
    if status == "timeout":
        raise ChatTemplateTimeout(value)
    if status != "ok":
        raise ChatTemplateError(value)
    return value
