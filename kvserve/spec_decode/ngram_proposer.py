"""Prompt lookup (vLLM's `"method": "ngram"`): drafts copied from the request's own prompt and output.

The longest suffix n-gram of the request's tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
that occurred earlier is looked up, and the tokens that followed its most recent earlier occurrence are the
draft (up to k of them). Rewrites, summaries with quotes and code edits repeat long stretches of their input,
so these drafts are often right, and they cost no model.

Per request the proposer keeps an index from the key of each n-gram (a hash salted by n: every n in one
table) to the end of its latest occurrence, in two parts: the bulk, built with numpy in one pass (the
prompt, or the whole context after many steps without drafting) into one sorted array, searched behind a
bitmap that answers most misses without a search; and the tokens added since, one dict entry per n-gram. A
step then costs O(new tokens x n) per request whatever the context length, and starting (or resuming after
a pause in drafting) costs one vectorized pass instead of a Python loop over the context. A key hit is
compared token by token, so a collision can only cost a draft, never a wrong one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

_BASE = 0x9E3779B97F4A7C15  # odd 64-bit multiplier of the polynomial hash
_SALT = 0xD6E8FEB86659FD93  # key of an n-gram = (hash + n * _SALT) * _MIX: n-grams of different n do not
# share keys (a hash alone would not tell [0, t] from [t]), and the odd multiplier carries every bit of the
# hash into the key's top bits, which the bulk keeps
_MIX = 0xBF58476D1CE4E5B9
_MASK = (1 << 64) - 1
# New tokens past which the index is rebuilt in one numpy pass instead of extended token by token in Python:
# more than REBUILD_MIN_TOKENS and more than 1/REBUILD_RATIO of the context (a rebuild costs about what
# extending by 1/10 of the context does).
REBUILD_MIN_TOKENS = 32
REBUILD_RATIO = 8
FILTER_BITS_PER_KEY = 16  # bitmap bits per bulk entry: a miss passes the filter with probability < 1/16


@dataclass
class _RequestIndex:
    tokens: list[int]
    num_prompt: int
    # The bulk: the n-grams of the tokens indexed at the last build (each followed by tokens[end]), packed
    # and sorted (NgramProposer._bulk); and a bitmap of their keys' top bits.
    bulk: np.ndarray
    end_bits: int
    bulk_filter: bytes
    filter_shift: int
    recent: dict[int, int] = field(default_factory=dict)  # key -> latest end, for n-grams after the build
    # The keys ending at the last lookup's length: the next token's extension adds exactly these.
    suffix_keys: tuple[int, list[int]] = (-1, [])


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min} and "
                             f"{prompt_lookup_max}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        # The hash of tokens[e - n:e] is sum over i = 1..n of tokens[e - i] * _BASE^(i - 1) mod 2^64, so the
        # keys of every n ending at e come out of one pass backwards from e.
        self._pow = [pow(_BASE, i, 1 << 64) for i in range(prompt_lookup_max)]
        self._salt = [(n * _SALT) & _MASK for n in range(prompt_lookup_max + 1)]
        self._requests: dict[str, _RequestIndex] = {}

    # ---- keys ----------------------------------------------------------------------------------------
    def _keys_ending_at(self, tokens: list[int], end: int) -> list[int]:
        """Keys of tokens[end - n:end] for n = min_n .. min(max_n, end), in that order."""
        keys, h, pw, salt = [], 0, self._pow, self._salt
        for n in range(1, min(self.max_n, end) + 1):
            h = (h + tokens[end - n] * pw[n - 1]) & _MASK
            if n >= self.min_n:
                keys.append(((h + salt[n]) * _MIX) & _MASK)
        return keys

    def _bulk(self, tokens: list[int]) -> tuple[np.ndarray, int]:
        """Every n-gram of `tokens` that some token follows, as (top bits of its key) << end_bits | its end,
        sorted (so by key, then end: a key's latest end is its last entry); and end_bits."""
        length = len(tokens)
        end_bits = max(1, length.bit_length())
        arr = np.asarray(tokens, dtype=np.uint64)
        acc = np.zeros(length, dtype=np.uint64)  # acc[e]: hash of the n tokens before e (uint64 wraps)
        ends = np.arange(length, dtype=np.uint64)
        shift = np.uint64(end_bits)
        packed = []
        for n in range(1, min(self.max_n, length - 1) + 1):
            acc[n:] += arr[:length - n] * np.uint64(self._pow[n - 1])
            if n >= self.min_n:
                keys = (acc[n:] + np.uint64(self._salt[n])) * np.uint64(_MIX)
                packed.append(((keys >> shift) << shift) | ends[n:])
        bulk = np.concatenate(packed) if packed else np.zeros(0, dtype=np.uint64)
        bulk.sort()
        return bulk, end_bits

    # ---- index ---------------------------------------------------------------------------------------
    def _build(self, tokens: list[int], num_prompt: int) -> _RequestIndex:
        bulk, end_bits = self._bulk(tokens)
        log_bits = max(10, (FILTER_BITS_PER_KEY * len(bulk)).bit_length())
        shift = 64 - log_bits
        bits = np.zeros(1 << log_bits, dtype=bool)
        bits[(bulk >> np.uint64(shift)).astype(np.int64)] = True
        return _RequestIndex(tokens=tokens, num_prompt=num_prompt, bulk=bulk, end_bits=end_bits,
                             bulk_filter=np.packbits(bits, bitorder="little").tobytes(), filter_shift=shift)

    @staticmethod
    def _bulk_end_of(index: _RequestIndex, key: int) -> int | None:
        """The latest end of `key` in the bulk (compared on its top bits), or None."""
        h = key >> index.filter_shift
        if not index.bulk_filter[h >> 3] >> (h & 7) & 1:
            return None
        end_bits = index.end_bits
        top = key >> end_bits
        # The last entry at or below the largest one this key can have (the method: np.searchsorted's
        # dispatch costs several times the search).
        pos = int(index.bulk.searchsorted(np.uint64((top << end_bits) | ((1 << end_bits) - 1)), side="right")) - 1
        if pos < 0:
            return None
        entry = int(index.bulk[pos])
        return entry & ((1 << end_bits) - 1) if entry >> end_bits == top else None

    def _extend(self, index: _RequestIndex, new_tokens: Iterable[int]) -> None:
        tokens, recent = index.tokens, index.recent
        for t in new_tokens:
            end = len(tokens)  # the n-grams ending here are now followed by t
            cached_end, keys = index.suffix_keys
            for key in keys if cached_end == end else self._keys_ending_at(tokens, end):
                recent[key] = end
            tokens.append(t)

    def _sync(self, request) -> _RequestIndex:
        rid = request.request_id
        index = self._requests.get(rid)
        outputs = request.output_token_ids
        if index is None or len(index.tokens) - index.num_prompt > len(outputs):
            index = self._requests[rid] = self._build(list(request.prompt_token_ids) + list(outputs),
                                                      len(request.prompt_token_ids))
            return index
        seen = len(index.tokens) - index.num_prompt
        new = len(outputs) - seen
        if new > max(REBUILD_MIN_TOKENS, len(index.tokens) // REBUILD_RATIO):
            index = self._requests[rid] = self._build(index.tokens + list(outputs[seen:]), index.num_prompt)
        elif new > 0:
            self._extend(index, outputs[seen:])
        return index

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ---- proposals -----------------------------------------------------------------------------------
    def _lookup(self, index: _RequestIndex, k: int) -> list[int]:
        tokens = index.tokens
        length = len(tokens)
        all_keys = self._keys_ending_at(tokens, length)
        index.suffix_keys = (length, all_keys)
        keys = all_keys[:max(0, length - self.min_n)]  # n <= length - 1: an earlier occurrence fits
        recent = index.recent
        for i in range(len(keys) - 1, -1, -1):  # the longest n first
            key = keys[i]
            end = recent.get(key)
            if end is None:
                end = self._bulk_end_of(index, key)
            n = self.min_n + i
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
