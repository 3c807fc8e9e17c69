"""Errors a step raises after cleaning up after itself (importable without torch: the server reads them)."""

from __future__ import annotations


class StepOutOfMemoryError(RuntimeError):
    """A step ran out of device memory; `request_ids` (the step's requests) were aborted, the engine goes on."""

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = request_ids

    def __reduce__(self):  # crosses the engine process boundary
        return (StepOutOfMemoryError, (str(self), self.request_ids))
