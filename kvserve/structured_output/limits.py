"""How long a constrained request's grammar may take to compile: past it the request is refused (the size
caps on schemas and tools are request limits, in kvserve/request_limits.py)."""

from __future__ import annotations

COMPILE_TIMEOUT_S = 10.0  # one grammar compile; past it the request is refused
