"""Batched sampling on the model's device, in vLLM's order:

raw logprobs -> allowed_token_ids / bad words / min_tokens masks -> logit_bias -> penalties
-> greedy argmax | temperature -> min_p -> top_k / top_p -> seeded or global draw.

Every step is a whole-batch tensor op; rows that do not use a feature are left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.sizing.memory_plan import SAMPLER_BLOCK_ELEMENTS

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


# Filters and draws go a block of rows at a time: sorting [rows, V] float32 holds its values, int64 indices,
# probabilities and their running sum at once, which over hundreds of rows of a large vocabulary (Gemma's 262k)
# was the largest set of tensors in a step, and start-up sizing takes a step's peak from the KV cache.
def _row_blocks(num_rows: int, vocab: int) -> list[slice]:
    """Consecutive row slices of at most SAMPLER_BLOCK_ELEMENTS values each (one row at least)."""
    step = max(1, SAMPLER_BLOCK_ELEMENTS // max(vocab, 1))
    return [slice(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one (in place on logits)."""
    for rows in _row_blocks(*logits.shape):
        x = logits[rows]
        probs = x.softmax(dim=-1)
        threshold = min_p[rows, None] * probs.amax(dim=-1, keepdim=True)
        x.masked_fill_(probs < threshold, float("-inf"))
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf, in place on logits) everything below each row's k-th largest logit and outside its top-p
    nucleus."""
    if top_k is None and top_p is None:
        return logits
    for rows in _row_blocks(*logits.shape):
        _top_k_top_p_rows(logits[rows], None if top_k is None else top_k[rows], None if top_p is None else top_p[rows])
    return logits


def _top_k_top_p_rows(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    sorted_logits, sorted_idx = x.sort(dim=-1, descending=True)
    vocab = x.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).long()
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))  # ties with the k-th stay
    if top_p is not None:
        probs = sorted_logits.softmax(-1)
        # Keep a token while the mass strictly before it is below top_p (the top token always stays);
        # top_p = 1 keeps everything even where float cumsum reaches 1 early.
        mass_before = probs.cumsum(-1).sub_(probs)
        del probs
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
        del mass_before
        sorted_logits.masked_fill_(drop, float("-inf"))
    x.scatter_(-1, sorted_idx, sorted_logits)


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
    """Draws a token per row of probs [B, V] (overwritten)."""
    # argmax(p / q) with q ~ Exp(1) draws from p; each seeded row draws q from its own generator,
    # so its tokens do not depend on the rest of the batch.
    sampled = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for rows in _row_blocks(*probs.shape):
        q = torch.empty_like(probs[rows])
        seeded = [(row - rows.start, gen) for row, gen in generators.items() if rows.start <= row < rows.stop]
        if len(seeded) != q.shape[0]:
            q.exponential_()
        for row, gen in seeded:
            q[row].exponential_(generator=gen)
        sampled[rows] = probs[rows].div_(q).argmax(dim=-1)
    return sampled


def processed_probs(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] float32 (overwritten) -> (greedy ids [B], the distribution each row samples from
    [B, V] in logits' own memory, or None when every row is greedy). The one place where the sampling
    parameters shape the distribution: the plain sampler draws from it, speculative decoding verifies drafts
    against it."""
    logits = apply_logit_edits(logits, meta)
    greedy = logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy, None
    temp = meta.temperature
    logits.div_(torch.where(temp < _SAMPLING_EPS, 1.0, temp)[:, None])
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p)
    apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    for rows in _row_blocks(*logits.shape):
        logits[rows] = logits[rows].softmax(dim=-1)
    return greedy, logits


def is_greedy_row(meta: SamplingMetadata) -> torch.Tensor | None:
    """[B] bool: rows at temperature 0 (None when every row is)."""
    return None if meta.all_greedy else meta.temperature < _SAMPLING_EPS


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """logits [B, V] float32 (overwritten) -> SamplerOutput."""
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
