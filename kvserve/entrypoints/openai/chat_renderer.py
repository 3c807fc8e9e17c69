"""Chat templates rendered in a child process, with a time, memory and output-size limit.

A jinja2 template is a program: the sandbox keeps it away from Python's internals, but not from looping
for ever (`{% for a in range(99999) %}{% for b in range(99999) %}`) or from building a huge string
(`'x' * 200000000`), and jinja offers no step counter that catches both. So the template runs where it
can be stopped: a worker process under an address-space limit, which is killed (and replaced) when a
render takes longer than its time limit. The event loop only waits on a pipe, from a thread.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import resource
import threading
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_OUTPUT_CHARS = 4_000_000
# Address space the worker may add to what it uses once the tokenizer is loaded.
_MEMORY_HEADROOM_BYTES = 1 << 30


class ChatTemplateError(ValueError):
    """The template refused these messages, ran too long, or produced too much (the client's error: 400)."""


class ChatTemplateTimeout(ChatTemplateError):
    """The render ran past the time limit (its worker was killed and replaced)."""


def _worker_main(conn, tokenizer_bytes: bytes, max_output_chars: int) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when its workers stop
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
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class ChatTemplateRenderer:
    """`await render(messages, **apply_chat_template_kwargs)` -> the prompt text, or ChatTemplateError;
    `render_sync` is the same for callers without an event loop (`LLM.chat`)."""

    def __init__(self, tokenizer, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS, startup_timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.startup_timeout_s = startup_timeout_s
        self._tokenizer_bytes = pickle.dumps(tokenizer)
        self._lock = threading.Lock()  # one render at a time per worker; the pool thread waits on it
        self._worker: _Worker | None = _Worker(self._tokenizer_bytes, max_output_chars)
        self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-chat-template")

    async def render(self, messages: list[dict], **kwargs) -> str:
        loop = asyncio.get_running_loop()
        return _text_or_raise(*await loop.run_in_executor(self._threads, self._render_blocking, messages, kwargs))

    def render_sync(self, messages: list[dict], **kwargs) -> str:
        return _text_or_raise(*self._render_blocking(messages, kwargs))

    def _render_blocking(self, messages, kwargs):
        with self._lock:
            if self._worker is None:
                self._worker = _Worker(self._tokenizer_bytes, self.max_output_chars)
            worker = self._worker
            try:
                worker.wait_ready(self.startup_timeout_s)
                reply = worker.call(messages, kwargs, self.timeout_s)
            except (EOFError, OSError, TimeoutError) as e:
                reply = ("error", f"the chat template worker failed ({type(e).__name__}); it was restarted")
                self._replace(worker)
                return reply
            if reply is None:
                logger.warning("A chat template render took longer than %.1f s; restarting its worker.",
                               self.timeout_s)
                self._replace(worker)
                return ("timeout", f"rendering the chat template took longer than {self.timeout_s:g} s")
            return reply

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._worker = _Worker(self._tokenizer_bytes, self.max_output_chars)

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._worker.kill()
                self._worker = None
        self._threads.shutdown(wait=False)


def _text_or_raise(status: str, value: str) -> str:
    if status == "timeout":
        raise ChatTemplateTimeout(value)
    if status != "ok":
        raise ChatTemplateError(value)
    return value
