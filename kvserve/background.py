"""Start-up work that can overlap other start-up work (loading a tokenizer while the model loads)."""

from __future__ import annotations

import concurrent.futures
import threading


def in_background(fn, *args) -> concurrent.futures.Future:
    """Runs fn(*args) on a daemon thread of its own; the future's .result() re-raises its exception."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name="kvserve-background", daemon=True).start()
    return future
