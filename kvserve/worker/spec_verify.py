"""Exact speculative sampling: verifies each request's draft tokens against the target model's distribution.

Request i brings k_i draft tokens d_1..d_k and the target's logits at its k_i + 1 positions (position j
scores the token that follows d_1..d_j). Draft d_{j+1} is accepted with probability min(1, p_j(d) / q_j(d));
at the first rejection the step ends with a token drawn from normalize(max(0, p_j - q_j)); when every draft
is accepted, a bonus token is drawn from p_k. This keeps the output distribution exactly the target's
(Leviathan et al. 2023, Chen et al. 2023). A draft without probabilities (n-gram lookup, a greedy draft
model) is a one-hot q. Greedy rows accept while the draft equals the target's argmax.

p is the distribution the plain sampler draws from (`kvserve.worker.sampler.processed_probs`), so
penalties, bans, temperature, min-p, top-k and top-p apply exactly as without speculation; the caller builds
the per-position sampling metadata with `spec_verify_metadata.build_verify_metadata`.

Random draws: a seeded request takes k_i uniforms and then one [V] exponential race from its own generator,
so its tokens depend only on its seed and its drafts; with no drafts that race is the plain sampler's draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.worker.spec_verify_metadata import build_verify_metadata
from kvserve.worker.sampler import SamplingMetadata, gather_logprobs, is_greedy_row, processed_probs


@dataclass
class DraftTokens:
    """The drafts of one verify step, requests in batch order."""

    num_draft_tokens: list[int]  # k_i per request (0 allowed)
    token_ids: torch.Tensor  # [sum k_i] int64, request after request
    probs: torch.Tensor | None = None  # [sum k_i, V] the draft's distribution per draft; None: one-hot drafts


@dataclass
class VerifyOutput:
    """`token_ids[i, :num_tokens[i]]`: request i's accepted drafts then one recovered or bonus token
    (the rest is -1). With logprobs, one row per output token (request after request), as SamplerOutput."""

    token_ids: torch.Tensor  # [B, max_k + 1] int64
    num_tokens: torch.Tensor  # [B] int64, 1..k_i + 1
    row_token_ids: torch.Tensor  # [sum(k_i + 1)] the output token at each position row, -1 past the end
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None

    def to_lists(self) -> list[list[int]]:
        ids, counts = self.token_ids.tolist(), self.num_tokens.tolist()
        return [row[:n] for row, n in zip(ids, counts)]


def _layout(num_draft: list[int], device) -> tuple[torch.Tensor, ...]:
    """Index tensors of the padded [B, max_k + 1] view of the flat per-position rows."""
    k = np.asarray(num_draft, dtype=np.int64)
    max_k = int(k.max(initial=0))
    first_row = np.cumsum(k + 1) - (k + 1)  # each request's first position row
    first_draft = np.cumsum(k) - k
    j = np.arange(max_k + 1)
    valid = j[None, :] <= k[:, None]  # position j exists (j == k_i: the bonus position)
    pos_rows = np.where(valid, first_row[:, None] + j, 0)
    draft_valid = j[None, :max_k] < k[:, None]
    draft_idx = np.where(draft_valid, first_draft[:, None] + j[:max_k], 0)
    to = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return to(k), to(pos_rows), to(draft_valid), to(draft_idx)


def _draws(batch: int, max_k: int, num_draft: list[int], vocab: int, generators: dict[int, torch.Generator],
           device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [B, max_k] for the acceptance tests, exponentials [B, V] for the final token's race."""
    u = torch.empty(batch, max_k, device=device)
    e = torch.empty(batch, vocab, device=device)
    if len(generators) != batch:
        u.uniform_()
        e.exponential_()
    for i, gen in generators.items():
        u[i, :num_draft[i]].uniform_(generator=gen)
        e[i].exponential_(generator=gen)
    return u, e


def verify_drafts(logits: torch.Tensor, requests: list, generators: dict[str, torch.Generator],
                  device: torch.device) -> VerifyOutput:
    """The runner's entry: `requests` (request_id, sampling_params, prompt/output token ids, output_len,
    spec_token_ids) in batch order, each owning 1 + len(spec_token_ids) consecutive logits rows."""
    drafts = [list(s.spec_token_ids) for s in requests]
    meta = build_verify_metadata(requests, drafts, logits.shape[-1], device)
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
    seeded = {j: generators[s.request_id] for j, s in enumerate(requests) if s.request_id in generators}
    return rejection_sample(logits, meta, DraftTokens([len(d) for d in drafts], flat), seeded)


def rejection_sample(logits: torch.Tensor, meta: SamplingMetadata, drafts: DraftTokens,
                     generators: dict[int, torch.Generator]) -> VerifyOutput:
    """logits [sum(k_i + 1), V] float32 (edited in place), each request's positions consecutive; `meta`
    has one row per position; `generators`: request index -> generator of a seeded request."""
    raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
    greedy, probs = processed_probs(logits, meta)
    device, vocab = logits.device, logits.shape[-1]
    num_draft = drafts.num_draft_tokens
    batch, max_k = len(num_draft), max(num_draft, default=0)
    k, pos_rows, draft_valid, draft_idx = _layout(num_draft, device)
    draft_ids = drafts.token_ids.to(device)[draft_idx].masked_fill(~draft_valid, 0)  # [B, max_k]
    target_greedy = greedy[pos_rows]  # [B, max_k + 1]
    accepted = draft_ids == target_greedy[:, :max_k]
    if probs is not None:
        greedy_rows = is_greedy_row(meta)[pos_rows[:, 0]]  # [B]; every position of a request shares it
        u, race = _draws(batch, max_k, num_draft, vocab, generators, device)
        p_draft = probs[pos_rows[:, :max_k], draft_ids]  # [B, max_k]
        q_draft = 1.0 if drafts.probs is None else drafts.probs.to(device)[draft_idx, draft_ids]
        accepted = torch.where(greedy_rows[:, None], accepted, u * q_draft < p_draft)
    accepted &= draft_valid
    # The step ends at the first rejected draft, or at the bonus position when all are accepted.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
    end_rows = pos_rows.gather(1, num_accepted[:, None]).squeeze(1)
    final = greedy[end_rows]
    if probs is not None:
        p_end = probs[end_rows]
        residual = p_end  # at the bonus position the token is drawn from p itself
        if max_k:
            at_end = num_accepted.clamp(max=max_k - 1)[:, None]
            if drafts.probs is None:
                q_end = torch.zeros_like(p_end).scatter_(1, draft_ids.gather(1, at_end), 1.0)
            else:
                q_end = drafts.probs.to(device)[draft_idx.gather(1, at_end).squeeze(1)]
            rejected = (num_accepted < k)[:, None]
            residual = (p_end - q_end).clamp_(min=0)
            # p == q leaves nothing; a rejection then had probability 0 and only rounding got here.
            residual = torch.where(rejected & (residual.sum(-1, keepdim=True) > 0), residual, p_end)
        final = torch.where(greedy_rows, final, residual.div_(race).argmax(dim=-1))
    positions = torch.arange(max_k + 1, device=device)
    token_ids = torch.cat([draft_ids, torch.zeros(batch, 1, dtype=torch.long, device=device)], dim=1)
    token_ids = token_ids.masked_fill(positions[None, :] > num_accepted[:, None], -1)
    token_ids.scatter_(1, num_accepted[:, None], final[:, None])
    keep = positions[None, :] <= num_accepted[:, None]
    row_token_ids = torch.full((logits.shape[0],), -1, dtype=torch.long, device=device)
    row_token_ids[pos_rows[keep]] = token_ids[keep]
    out = VerifyOutput(token_ids=token_ids, num_tokens=num_accepted + 1, row_token_ids=row_token_ids)
    if raw_logprobs is not None:
        out.logprob_token_ids, out.logprobs, out.sampled_ranks = gather_logprobs(
            raw_logprobs[pos_rows[keep]], min(meta.max_num_logprobs, vocab), token_ids[keep])
    return out
