"""Signals in the server's child processes (engine core, workers, chat template renderers)."""

from __future__ import annotations

import signal


def ignore_group_signals() -> None:
    """The server decides when its children stop: it drains first, then stops them itself. A Ctrl-C in the
    terminal, or systemd's or Kubernetes' SIGTERM, reaches the whole process group and must not kill them
    under in-flight requests. Whoever starts such a child must therefore join it (and kill it if it does
    not stop) before interpreter exit: multiprocessing's exit handler would SIGTERM it and wait for ever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
