"""Limits at the HTTP layer, before any route runs: the size of a request body, and how long a client may
take to send a request's headers (uvicorn bounds idle keep-alive connections, not half-sent headers, so
a client that never finishes them would hold its connection for ever)."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.entrypoints.openai.cli_args import DEFAULT_HEADER_TIMEOUT_S
from kvserve.entrypoints.openai.errors import error_response

_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


class BodyLimitMiddleware:
    """Reads a request's body before the app does, refusing it with 413 (OpenAI JSON) past `max_bytes`; the
    app then reads the buffered body and, after it, the connection's own messages (so disconnects still
    reach it). A Content-Length above the limit is refused before a byte of the body is read."""

    def __init__(self, app, max_bytes: int, idle_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S):
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout_s = idle_timeout_s  # a body that stalls this long gets 408: no slow-body hold

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in _METHODS_WITH_BODY:
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await error_response("Invalid Content-Length header.", 400)(scope, receive, send)
                if declared > self.max_bytes:
                    return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.idle_timeout_s)
            except asyncio.TimeoutError:
                response = error_response(f"No request body data for {self.idle_timeout_s:g} s.", 408)
                response.headers["connection"] = "close"
                return await response(scope, receive, send)
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
        response.headers["connection"] = "close"
        return await response(scope, receive, send)


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not complete within
    `timeout_s` of the connection opening or of the previous response ending."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer = None
        _armed_cycle = None

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._armed_cycle = self.cycle
            self._header_timer = self.loop.call_later(timeout_s, self._header_timeout)

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
            super().connection_made(transport)
            self._arm_header_timer()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._armed_cycle:
                self._disarm_header_timer()  # a request's headers arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol
