"""The Host header check, against DNS rebinding: a web page can make a browser send requests to a server
on the browser's own machine under a name the page controls (evil.example resolving to 127.0.0.1), and
read the answers. A server that listens on loopback only and has no API key would otherwise serve such a
page. So there, a request's Host must name this server: the bound address, localhost, 127.0.0.1 or
[::1] (with the bound port, or none), or a name given with --allowed-hosts; anything else gets 421."""

from __future__ import annotations

import ipaddress

from kvserve.entrypoints.openai.errors import error_response

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> tuple[str, str | None]:
    """'Name:port' -> ('name', 'port'); '[::1]:80' -> ('[::1]', '80'); no port -> (name, None)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[:end + 1], value[end + 1:]
        return name, rest[1:] if rest.startswith(":") else None
    name, sep, port = value.rpartition(":")
    if sep and port.isdigit():
        return name, port
    return value, None


class HostCheckMiddleware:
    def __init__(self, app, bind_host: str, port: int, allowed_hosts: list[str] | tuple = ()):
        self.app = app
        self.port = str(port)
        bound = f"[{bind_host}]" if ":" in bind_host and not bind_host.startswith("[") else bind_host
        self.names = {n.lower() for n in (*_LOOPBACK_NAMES, bound)}
        self.exact = set()  # --allowed-hosts entries that name a port: that port only
        for entry in allowed_hosts:
            name, port = _split_host(entry)
            if port is None:
                self.names.add(name)
            else:
                self.exact.add((name, port))

    def allowed(self, host: bytes | None) -> bool:
        if host is None:
            return True  # HTTP/1.0 without Host: no browser sends that
        name, port = _split_host(host.decode("latin-1"))
        if (name, port) in self.exact:
            return True
        return name in self.names and port in (None, self.port)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = next((v for k, v in scope.get("headers", ()) if k == b"host"), None)
            if not self.allowed(host):
                shown = host.decode("latin-1")[:100] if host else ""
                response = error_response(
                    f"Host {shown!r} is not this server's (it listens on loopback without --api-key, so only "
                    f"localhost names are served, against DNS rebinding). Add the name with --allowed-hosts, "
                    f"or set --api-key.", 421)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
