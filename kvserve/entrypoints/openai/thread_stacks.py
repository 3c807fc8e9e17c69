"""`kill -USR1 <server pid>`: every thread's Python stack, written to the server's log (stderr).

The handler is a Python one: the main thread runs it between bytecodes, holding the GIL, so the other
threads' frames stand still while they are read. faulthandler's C handler reads them without the GIL, from
inside the signal, and a server whose threads were busy (one importing a module at the time) died mid-dump.
The cost: a main thread stuck inside one C call writes nothing until the call returns.
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback


def format_thread_stacks() -> str:
    """Every live thread's stack, most recent call last, the calling thread marked."""
    names = {t.ident: t.name for t in threading.enumerate()}
    current = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        label = "Current thread" if ident == current else "Thread"
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"{label} 0x{ident:016x} ({names.get(ident, 'not started by threading')}), "
                     f"most recent call last:\n{stack}")
    return "\n".join(parts)


_writing = False


def _write_stacks(signum, frame) -> None:
    global _writing
    if _writing:  # a signal that comes while a dump is written is answered by that dump
        return
    _writing = True
    try:
        sys.stderr.write(format_thread_stacks() + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a diagnostic must never take the server down
        pass
    finally:
        _writing = False


def install(sig: int = signal.SIGUSR1) -> None:
    """Call from the main thread (Python delivers signals there only)."""
    signal.signal(sig, _write_stacks)
