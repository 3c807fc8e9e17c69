"""Verifying draft tokens: which of a request's drafts the target model accepts, and the token after them.

A request with k drafts has 1 + k logits rows: the model's distribution after each draft prefix. Each row
is sampled with the request's own sampling parameters; the drafts are accepted up to the first one that
differs from what was sampled at its position, and the sample at that position (or after the last draft)
is the extra token. Greedy decoding therefore gives exactly the tokens of a run without drafts. For
temperature > 0 this is "sample and compare", which keeps the target's distribution per token only when
the drafts come from the same distribution; exact rejection sampling replaces this body (same signature).
"""

from __future__ import annotations

import torch

from kvserve.worker.sampler import SamplingMetadata, sample


def verify(logits: torch.Tensor, meta: SamplingMetadata, draft_token_ids: list[list[int]]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] (R = sum of 1 + len(drafts), request by request), one metadata row per logits row.

    Returns (sampled [R], the id sampled at every row; output [B, 1 + max k]: per request the accepted
    drafts and then the extra token, padded with -1), both on the device."""
    sampled = sample(logits, meta).sampled
    device = sampled.device
    num_drafts = [len(d) for d in draft_token_ids]
    max_k = max(num_drafts)
    num_reqs = len(draft_token_ids)
    # grid[b, i] = flat row of request b's i-th position; positions past its drafts point at a pad row.
    lens = torch.tensor(num_drafts, dtype=torch.int64)
    starts = torch.cumsum(lens + 1, 0) - (lens + 1)
    cols = torch.arange(max_k + 1)
    valid = cols[None, :] <= lens[:, None]
    grid = torch.where(valid, starts[:, None] + cols[None, :], sampled.numel())
    padded = torch.cat([sampled, sampled.new_full((1,), -1)])
    target = padded[grid.to(device)]  # [B, 1 + max k]
    drafts = torch.full((num_reqs, max_k + 1), -2, dtype=torch.int64)  # -2 never equals a sampled id
    for b, d in enumerate(draft_token_ids):
        if d:
            drafts[b, :len(d)] = torch.tensor(d, dtype=torch.int64)
    match = target[:, :max_k] == drafts[:, :max_k].to(device)
    num_accepted = torch.cumprod(match.to(torch.int64), dim=1).sum(dim=1)  # leading matches
    keep = cols.to(device)[None, :] <= num_accepted[:, None]
    return sampled, torch.where(keep, target, torch.full_like(target, -1))
