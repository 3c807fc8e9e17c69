"""The limits on constrained requests, each checked here and nowhere else.

A grammar's compile time and memory grow with its size, so a size cap plus a compile timeout is what keeps
one pathological schema from stalling the server.
"""

from __future__ import annotations

MAX_SPEC_CHARS = 64 * 1024  # a JSON schema, regex, grammar or structural tag, as text
MAX_TOOLS = 128  # tools in one chat request
COMPILE_TIMEOUT_S = 10.0  # one grammar compile; past it the request is refused


def check_spec_size(name: str, spec: str) -> None:
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"{name} is {len(spec)} characters long, more than the limit of {MAX_SPEC_CHARS}; "
                         f"send a smaller schema or grammar.")


def check_num_tools(num_tools: int) -> None:
    if num_tools > MAX_TOOLS:
        raise ValueError(f"tools has {num_tools} entries, more than the limit of {MAX_TOOLS}.")
