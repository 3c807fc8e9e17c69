"""Limits at the HTTP layer, before any route runs: how many connections are open at once, how long a
client may take to send a request's headers and its whole body, how large that body may be, and framing
that two parsers could read differently (Content-Length together with Transfer-Encoding).

uvicorn bounds idle keep-alive connections, not half-sent requests: a client that trickles its headers or
its body one byte at a time would hold its connection (a file descriptor) for ever, and enough of them
exhaust the process's descriptors. So the headers have a deadline from the connection's start, the body a
deadline of its own (in total, not per byte), and connections past --max-concurrent-connections are
answered 503 and closed as soon as they open."""

from __future__ import annotations

import asyncio
import json
import logging
import resource

from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.entrypoints.openai.cli_args import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
)
from kvserve.entrypoints.openai.errors import error_body, error_response

logger = logging.getLogger(__name__)

# Descriptors the process needs besides client connections: model files, pipes, the engine's sockets.
_FD_HEADROOM = 256

_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


class BodyLimitMiddleware:
    """Reads a request's body before the app does, refusing it with 413 (OpenAI JSON) past `max_bytes` and
    with 408 when it is not complete `body_timeout_s` after the headers (or pauses `idle_timeout_s`); the
    app then reads the buffered body and, after it, the connection's own messages (so disconnects still
    reach it). A Content-Length above the limit is refused before a byte of the body is read, and one
    sent together with Transfer-Encoding is refused (400): which of the two frames the body is exactly
    what a proxy in front and this server could disagree on (request smuggling)."""

    def __init__(self, app, max_bytes: int, idle_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S):
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout_s = idle_timeout_s
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = None
        chunked = False
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await _closing(error_response("Invalid Content-Length header.", 400), scope, receive, send)
            elif name == b"transfer-encoding":
                chunked = True
        if declared is not None and chunked:
            return await _closing(error_response(
                "A request may not carry both Content-Length and Transfer-Encoding; send one of them.", 400),
                scope, receive, send)
        if scope["method"] not in _METHODS_WITH_BODY:
            return await self.app(scope, receive, send)
        if declared is not None and declared > self.max_bytes:
            return await self._too_large(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks, size = [], 0
        while True:
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), min(remaining, self.idle_timeout_s))
            except TimeoutError:
                if loop.time() >= deadline:
                    why = (f"The request body was not complete within {self.body_timeout_s:g} s "
                           f"(--request-body-timeout).")
                else:
                    why = f"No request body data for {self.idle_timeout_s:g} s (--header-timeout)."
                return await _closing(error_response(why, 408), scope, receive, send)
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        buffered = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return buffered.pop() if buffered else await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        response = error_response(
            f"The request body is larger than the server's limit of {self.max_bytes} bytes "
            f"(--max-request-body-bytes).", 413)
        return await _closing(response, scope, receive, send)


async def _closing(response, scope, receive, send):
    response.headers["connection"] = "close"
    return await response(scope, receive, send)


def _refusal_bytes(max_connections: int) -> bytes:
    body = json.dumps(error_body(
        f"The server has {max_connections} connections open, its limit (--max-concurrent-connections); "
        f"retry shortly.", 503)).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n").encode()
    return head + body


def limited_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol, which (1) answers a connection opened while `max_connections` are open with
    a 503 and closes it at once, before reading anything from it, and (2) closes a connection whose next
    request's headers are not complete within `header_timeout_s` of the connection opening or of the
    previous response ending."""
    refusal = _refusal_bytes(max_connections)
    refused_log = _RefusalLog(max_connections)

    class LimitedH11Protocol(H11Protocol):
        _header_timer = None
        _armed_cycle = None
        _refused = False

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._armed_cycle = self.cycle
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            idle = self.cycle is None or self.cycle.response_complete
            if idle and self.cycle is self._armed_cycle and not self.transport.is_closing():
                self.transport.close()  # no request started since the timer was armed

        def connection_made(self, transport) -> None:
            if len(self.server_state.connections) >= max_connections:
                self._refused = True
                self.transport = transport
                transport.write(refusal)
                transport.close()  # flushes the 503, then frees the descriptor
                refused_log.refused(self.loop)
                return
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def eof_received(self) -> None:
            if not self._refused:
                super().eof_received()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._armed_cycle:
                self._disarm_header_timer()  # a request's headers arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._refused:
                return
            self._disarm_header_timer()
            super().connection_lost(exc)

    return LimitedH11Protocol


class _RefusalLog:
    """One log line for the first refused connection, then at most one per `interval_s` with how many
    followed: an expected flood costs a few lines, not one per socket."""

    def __init__(self, max_connections: int, interval_s: float = 10.0):
        self.max_connections = max_connections
        self.interval_s = interval_s
        self.pending = 0
        self.flush_scheduled = False

    def refused(self, loop) -> None:
        if not self.flush_scheduled:
            logger.warning("Refused a connection: %d open, the limit of --max-concurrent-connections.",
                           self.max_connections)
            self.flush_scheduled = True
            loop.call_later(self.interval_s, self._flush, loop)
        else:
            self.pending += 1

    def _flush(self, loop) -> None:
        if self.pending:
            logger.warning("Refused %d more connection(s) in %g s (--max-concurrent-connections %d).",
                           self.pending, self.interval_s, self.max_connections)
            self.pending = 0
            loop.call_later(self.interval_s, self._flush, loop)
        else:
            self.flush_scheduled = False


def fit_connection_limit(max_connections: int) -> int:
    """Raises the soft descriptor limit so `max_connections` client sockets fit beside the process's own
    descriptors (as vLLM raises RLIMIT_NOFILE at start-up); lowers the limit, with a warning, where the
    hard limit does not allow that: connections are then refused with a 503 before accept() can fail."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return max_connections
    wanted = max_connections + _FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fitted = max(1, soft - _FD_HEADROOM)
        logger.warning("--max-concurrent-connections %d does not fit the descriptor limit (ulimit -n %d); "
                       "using %d.", max_connections, soft, fitted)
        return fitted
    return max_connections
