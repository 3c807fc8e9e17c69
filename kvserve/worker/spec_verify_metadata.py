"""Sampling metadata for a verify step: one row per position, each seeing the drafts before it.

Position j of a request scores the token after its first j drafts, so everything that depends on the
output so far (penalties, bad words, min_tokens) must see those drafts as if they had been sampled. Each
position is handed to the plain sampler's metadata builder as a request of its own, so no sampling rule
is written twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.worker.sampler import SamplingMetadata
from kvserve.worker.sampling_metadata import build_sampling_metadata


@dataclass
class _DraftPosition:
    """What the metadata builder reads of a request, at one draft position."""

    request_id: str
    sampling_params: object
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_len: int


def draft_positions(scheduled: list, drafts: list[list[int]]) -> list[_DraftPosition]:
    """`scheduled[i]` (request_id, sampling_params, prompt/output token ids, output_len) with `drafts[i]`
    -> its len(drafts[i]) + 1 positions, request after request."""
    positions = []
    for s, draft in zip(scheduled, drafts):
        outputs = s.output_token_ids
        if draft and s.sampling_params.needs_output_history:
            outputs = list(outputs[:s.output_len]) + list(draft)  # copied only when a rule reads them
        for j in range(len(draft) + 1):
            positions.append(_DraftPosition(s.request_id, s.sampling_params, s.prompt_token_ids, outputs,
                                            s.output_len + j))
    return positions


def build_verify_metadata(scheduled: list, drafts: list[list[int]], vocab_size: int,
                          device: torch.device) -> SamplingMetadata:
    """Per-position metadata; generators stay with the rejection sampler (one per request, not per row)."""
    return build_sampling_metadata(draft_positions(scheduled, drafts), {}, vocab_size, device)
