"""Prompt lookup (vLLM's `"method": "ngram"`): drafts copied from the request's own prompt and output.

The longest suffix n-gram of the request's tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
that occurred earlier is looked up, and the tokens that followed its most recent earlier occurrence are the
draft (up to k of them). Rewrites, summaries with quotes and code edits repeat long stretches of their input,
so these drafts are often right, and they cost no model.

Per request the proposer keeps, for each n, a dict from the hash of every n-gram to the end of its latest
occurrence. New tokens only add their own n-grams, so a step costs O(new tokens x n) per request whatever
the context length; a prompt is hashed once with numpy. A hash hit is compared token by token, so a
collision can only cost a draft, never a wrong one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

_BASE = 0x9E3779B97F4A7C15  # odd 64-bit multiplier of the polynomial hash
_MASK = (1 << 64) - 1


def _hash_ending_at(tokens: list[int], end: int, n: int) -> int:
    """Polynomial hash mod 2^64 of tokens[end - n:end] (the same value `_bulk_hashes` computes)."""
    h = 0
    for t in tokens[end - n:end]:
        h = (h * _BASE + t) & _MASK
    return h


def _bulk_hashes(tokens: np.ndarray, n: int, ends: np.ndarray) -> np.ndarray:
    """Hashes of tokens[e - n:e] for every e in `ends`, vectorized (uint64 arithmetic wraps mod 2^64)."""
    h = np.zeros(len(ends), dtype=np.uint64)
    base = np.uint64(_BASE)
    for i in range(n):
        h = h * base + tokens[ends - n + i].astype(np.uint64)
    return h


@dataclass
class _RequestIndex:
    tokens: list[int] = field(default_factory=list)
    num_prompt: int = 0
    # by_n[n - min_n]: hash of an n-gram -> end of its latest occurrence that some token follows.
    by_n: list[dict[int, int]] = field(default_factory=list)


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min} and "
                             f"{prompt_lookup_max}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._requests: dict[str, _RequestIndex] = {}

    # ---- index ---------------------------------------------------------------------------------------
    def _start(self, prompt: list[int]) -> _RequestIndex:
        index = _RequestIndex(tokens=list(prompt), num_prompt=len(prompt))
        arr = np.asarray(prompt, dtype=np.int64)
        for n in range(self.min_n, self.max_n + 1):
            # n-grams that a prompt token follows: ends n .. len - 1; dict() keeps the latest end per hash.
            ends = np.arange(n, len(prompt), dtype=np.int64)
            index.by_n.append(dict(zip(_bulk_hashes(arr, n, ends).tolist(), ends.tolist())))
        return index

    def _extend(self, index: _RequestIndex, new_tokens: Iterable[int]) -> None:
        tokens = index.tokens
        for t in new_tokens:
            end = len(tokens)  # the n-grams ending here are now followed by t
            tokens.append(t)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.by_n[n - self.min_n][_hash_ending_at(tokens, end, n)] = end

    def _sync(self, request) -> _RequestIndex:
        rid = request.request_id
        index = self._requests.get(rid)
        outputs = request.output_token_ids
        if index is None or len(index.tokens) - index.num_prompt > len(outputs):
            index = self._requests[rid] = self._start(request.prompt_token_ids)
        seen = len(index.tokens) - index.num_prompt
        if seen < len(outputs):
            self._extend(index, outputs[seen:])
        return index

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ---- proposals -----------------------------------------------------------------------------------
    def _lookup(self, index: _RequestIndex, k: int) -> list[int]:
        tokens = index.tokens
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.by_n[n - self.min_n].get(_hash_ending_at(tokens, length, n))
            if end is not None and tokens[end - n:end] == tokens[length - n:]:
                return tokens[end:end + k]
        return []

    def propose(self, requests: Iterable, num_tokens: int | None = None) -> dict[str, list[int]]:
        """`requests`: objects with request_id, prompt_token_ids and output_token_ids (the tokens known so
        far). Returns up to `num_tokens` (default k) draft tokens per request that has a match."""
        k = self.k if num_tokens is None else min(num_tokens, self.k)
        drafts = {}
        if k <= 0:
            return drafts
        seen = set()
        for request in requests:
            seen.add(request.request_id)
            draft = self._lookup(self._sync(request), k)
            if draft:
                drafts[request.request_id] = draft
        # Requests no longer offered (finished, aborted, preempted) give their index back; a resumed one
        # is indexed again from its tokens.
        for rid in [r for r in self._requests if r not in seen]:
            del self._requests[rid]
        return drafts
