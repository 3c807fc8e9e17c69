"""Logging that a client cannot abuse: what a request carries (its request_id, a field name) is logged with
its control characters escaped, so a newline in it cannot forge a log line; and the messages an attack
makes expected (asyncio's and uvicorn's per-connection errors) are rate limited, so a flood of bad
connections costs a few lines a minute, not megabytes."""

from __future__ import annotations

import logging
import re
import time

_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")
# Loggers that write one record per misbehaving connection.
NOISY_LOGGERS = ("asyncio", "uvicorn.error")


def escape_control(text: str) -> str:
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class EscapeControlCharacters(logging.Filter):
    """Escapes control characters in a record's string arguments (the format string is ours)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, str) for a in args):
            record.args = tuple(escape_control(a) if isinstance(a, str) else a for a in args)
        elif isinstance(args, dict):
            record.args = {k: escape_control(v) if isinstance(v, str) else v for k, v in args.items()}
        return True


class RateLimit(logging.Filter):
    """Lets through at most `burst` records of one message template per `interval_s`; the first record
    after a quiet interval says how many were suppressed."""

    def __init__(self, burst: int = 5, interval_s: float = 60.0, max_templates: int = 256):
        super().__init__()
        self.burst = burst
        self.interval_s = interval_s
        self.max_templates = max_templates
        self._windows: dict[str, list] = {}  # template -> [window start, passed, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)[:200]
        now = time.monotonic()
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.interval_s:
            suppressed = window[2] if window is not None else 0
            if window is None and len(self._windows) >= self.max_templates:
                self._windows.clear()  # attacker-chosen texts must not grow this without bound
            self._windows[key] = [now, 1, 0]
            if suppressed:
                record.msg = f"{record.msg} [{suppressed} similar message(s) suppressed in the last {self.interval_s:g} s]"
            return True
        if window[1] < self.burst:
            window[1] += 1
            return True
        window[2] += 1
        return False


def install(handlers=None) -> None:
    """Adds the escaping filter to `handlers` (default: the root logger's) and rate limits NOISY_LOGGERS."""
    for handler in handlers if handlers is not None else logging.getLogger().handlers:
        if not any(isinstance(f, EscapeControlCharacters) for f in handler.filters):
            handler.addFilter(EscapeControlCharacters())
    for name in NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimit) for f in logger.filters):
            logger.addFilter(RateLimit())
        if not any(isinstance(f, EscapeControlCharacters) for f in logger.filters):
            logger.addFilter(EscapeControlCharacters())
