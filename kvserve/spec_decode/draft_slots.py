"""The engine's side of `"method": "draft_model"` and `"eagle3"`: the draft model or head runs on the
workers, in the step that verifies its drafts (kvserve/worker/draft_model_runner.py, eagle3_runner.py),
so the engine only reserves draft slots.

Each running request is offered k placeholder drafts; the scheduler caps and allocates them like any
drafts, and the workers write the draft model's tokens into them before the target's forward. A request
with structured outputs is offered none: its grammar would have to mask draft positions whose tokens the
engine never sees before the step.
"""

from __future__ import annotations

from collections.abc import Iterable

# The id a slot carries until the draft fills it (a valid id: an unfilled slot is verified, and rejected
# unless the target would have produced it).
SLOT_TOKEN_ID = 0


class DraftSlots:
    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens

    def propose(self, requests: Iterable, num_tokens: int | None = None) -> dict[str, list[int]]:
        k = self.k if num_tokens is None else min(num_tokens, self.k)
        if k <= 0:
            return {}
        return {r.request_id: [SLOT_TOKEN_ID] * k for r in requests
                if getattr(r.sampling_params, "structured_outputs", None) is None}
