"""Batched sampling on the model's device, in vLLM's order:

raw logprobs -> allowed_token_ids / bad words / min_tokens masks -> logit_bias -> penalties
-> greedy argmax | temperature -> min_p -> top_k / top_p -> seeded or global draw.

Every step is a whole-batch tensor op; rows that do not use a feature are left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SAMPLING_EPS = 1e-5


@dataclass
class Penalties:
    """Repetition / frequency / presence penalties, for the rows of the batch that use one."""

    rows: torch.Tensor  # [R] int64 batch rows
    presence: torch.Tensor  # [R] float32
    frequency: torch.Tensor  # [R] float32
    repetition: torch.Tensor  # [R] float32
    output_counts: torch.Tensor  # [R, V] float32: how often each token was generated so far
    prompt_mask: torch.Tensor | None  # [R, V] bool: token occurs in the prompt; None without repetition penalty


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [B] float32; 0 = greedy; None when all rows are greedy
    top_k: torch.Tensor | None  # [B] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32, 1 = off
    min_p: torch.Tensor | None  # [B] float32, 0 = off
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    all_greedy: bool
    max_num_logprobs: int | None = None  # top alternatives to return (the batch's largest ask); None: none
    disallowed: tuple[torch.Tensor, torch.Tensor] | None = None  # [Ra] rows, [Ra, V] True = not in allowed_token_ids
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf: bad words, min_tokens
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, bias)
    penalties: Penalties | None = None


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    # With logprobs: [B, 1 + K] token ids and logprobs (column 0 = the sampled token, then the top K),
    # and [B] the sampled token's rank, all from the raw model distribution.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt and output tokens, frequency and presence over output tokens."""
    x = logits[p.rows]
    seen = p.output_counts > 0
    if p.prompt_mask is not None:
        rep = torch.where(seen | p.prompt_mask, p.repetition[:, None], 1.0)
        x = torch.where(x > 0, x / rep, x * rep)
    x = x - p.frequency[:, None] * p.output_counts - p.presence[:, None] * seen
    logits[p.rows] = x
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) everything below each row's k-th largest logit and outside its top-p nucleus."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).long()
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # ties with the k-th stay
    if top_p is not None:
        probs = sorted_logits.softmax(-1)
        # Keep a token while the mass strictly before it is below top_p (the top token always stays);
        # top_p = 1 keeps everything even where float cumsum reaches 1 early.
        mass_before = probs.cumsum(-1) - probs
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def apply_logit_edits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Everything that can change even a greedy choice (in place on logits)."""
    if meta.disallowed is not None:
        rows, mask = meta.disallowed
        logits[rows] = logits[rows].masked_fill(mask, float("-inf"))
    if meta.banned is not None:
        logits[meta.banned] = float("-inf")
    if meta.logit_bias is not None:
        rows, toks, bias = meta.logit_bias
        logits.index_put_((rows, toks), bias, accumulate=True)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    return logits


def gather_logprobs(logprobs: torch.Tensor, num: int, token_ids: torch.Tensor):
    """[N, V] logprobs -> ([N, 1 + num] ids, [N, 1 + num] logprobs, [N] rank of token_ids)."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs >= chosen).sum(-1)  # ties count against the token, as in vLLM
    if num > 0:
        top_lp, top_ids = logprobs.topk(num, dim=-1)
        return torch.cat([token_ids[:, None], top_ids], 1), torch.cat([chosen, top_lp], 1), ranks
    return token_ids[:, None], chosen, ranks


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    # argmax(p / q) with q ~ Exp(1) draws from p; each seeded row draws q from its own generator,
    # so its tokens do not depend on the rest of the batch.
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return probs.div_(q).argmax(dim=-1)


def processed_probs(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] float32 (edited in place) -> (greedy ids [B], the distribution each row samples from
    [B, V], or None when every row is greedy). The one place where the sampling parameters shape the
    distribution: the plain sampler draws from it, speculative decoding verifies drafts against it."""
    logits = apply_logit_edits(logits, meta)
    greedy = logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy, None
    temp = meta.temperature
    scaled = logits / torch.where(temp < _SAMPLING_EPS, 1.0, temp)[:, None]
    if meta.min_p is not None:
        scaled = apply_min_p(scaled, meta.min_p)
    scaled = apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
    return greedy, scaled.softmax(dim=-1)


def is_greedy_row(meta: SamplingMetadata) -> torch.Tensor | None:
    """[B] bool: rows at temperature 0 (None when every row is)."""
    return None if meta.all_greedy else meta.temperature < _SAMPLING_EPS


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """logits [B, V] float32 (edited in place) -> SamplerOutput."""
    raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
    greedy, probs = processed_probs(logits, meta)
    if probs is None:
        sampled = greedy
    else:
        sampled = torch.where(is_greedy_row(meta), greedy, random_sample(probs, meta.generators))
    out = SamplerOutput(sampled=sampled)
    if raw_logprobs is not None:
        out.logprob_token_ids, out.logprobs, out.sampled_ranks = gather_logprobs(
            raw_logprobs, min(meta.max_num_logprobs, logits.shape[-1]), sampled)
    return out
