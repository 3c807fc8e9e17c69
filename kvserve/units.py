"""Units and integer helpers used across layers (torch-free, so the pure-Python core can use them)."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers."""
    return -(-a // b)
