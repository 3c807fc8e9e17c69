"""Logging that a client cannot abuse (kvserve/log_safety.py): control characters in what a request
carries are escaped, and a flood of one expected message costs a few lines."""

from __future__ import annotations

import io
import logging

from kvserve import log_safety


def _logger(name: str):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger(name)
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, handler, stream


def test_control_characters_in_arguments_are_escaped():
    logger, handler, stream = _logger("kvserve.test.escape")
    log_safety.install([handler])
    logger.info("request %s finished", "r1\nINFO forged line\r\x1b[2J")
    logger.info("fields %(name)s", {"name": "a\u2028b"})
    lines = stream.getvalue().splitlines()
    assert lines == ["INFO request r1\\nINFO forged line\\r\\x1b[2J finished", "INFO fields a\\u2028b"]


def test_a_flood_of_one_message_is_rate_limited():
    logger, _, stream = _logger("kvserve.test.flood")
    limit = log_safety.RateLimit(burst=3, interval_s=3600)
    logger.addFilter(limit)
    for i in range(1000):
        logger.error("connection %d failed", i)
    logger.error("another message")
    lines = stream.getvalue().splitlines()
    assert lines == ["ERROR connection 0 failed", "ERROR connection 1 failed", "ERROR connection 2 failed",
                     "ERROR another message"]
    limit._windows["connection %d failed"][0] -= 3600  # the interval passed
    logger.error("connection %d failed", 1000)
    assert stream.getvalue().splitlines()[-1] == ("ERROR connection 1000 failed [997 similar message(s) "
                                                  "suppressed in the last 3600 s]")
