"""Batched sampling on the model's device: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor | None  # [B] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32, 1 = off
    min_p: torch.Tensor | None  # [B] float32, 0 = off
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    all_greedy: bool


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device)
        drop |= ranks[None, :] >= k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # Keep a token while the mass strictly before it is below top_p (the top token always stays).
        mass_before = probs.cumsum(-1) - probs
        drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] int64."""
    greedy = logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy
    temp = meta.temperature.clamp_min(1e-5)
    logits = logits / temp[:, None]
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)
    if meta.min_p is not None:
        top_prob = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < meta.min_p[:, None] * top_prob, 0.0)
    # Gumbel-style draw: argmax(p / q), q ~ Exp(1), equals sampling from p; each seeded row draws
    # from its own generator, so its tokens do not depend on the rest of the batch.
    q = torch.empty_like(probs).exponential_()
    for row, gen in meta.generators.items():
        q[row].exponential_(generator=gen)
    sampled = (probs / q).argmax(dim=-1)
    return torch.where(meta.temperature < 1e-5, greedy, sampled)
