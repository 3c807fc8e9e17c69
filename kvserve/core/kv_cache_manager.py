"""Per-request block tables on top of the block pool: prefix-cache lookup, slot allocation, freeing.

A model's layers form KV cache groups (core/kv_cache_groups.py), each with its own block table per
request (core/group_block_tables.py) on one shared pool: a model whose layers all attend alike has one
group; an interleaved local/global model (Gemma) has full groups, which keep every block, and windowed
ones, which free the blocks that left their window. Block ids travel per group: a tuple with one list
per group, in group order. A prefix hit covers n blocks only where every group has what it reads of them
(all n blocks in a full group, those inside the window of the first computed token in a windowed one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from kvserve.core.group_block_tables import FREED, GroupBlockTables, first_block_in_window  # noqa: F401
from kvserve.core.kv_cache_groups import request_blocks
from kvserve.core.request import Request
from kvserve.core.swap_space import SwapSpace
from kvserve.units import cdiv  # noqa: F401 - the scheduler and tests read it from here

# One list per KV cache group: block ids (what the runner gets) or blocks (prefix hits).
GroupBlockIds = tuple[list[int], ...]
GroupBlocks = Sequence[list[KVBlock]]


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_cpu_blocks: int = 0,
                 group_windows: Sequence[int | None] = (None,)):
        """group_windows: each KV cache group's window (None: full attention), as kv_cache_groups() orders
        them; the default is one group of full-attention layers."""
        if not group_windows:
            raise ValueError("the KV cache needs at least one group")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.groups = [GroupBlockTables(self.pool, block_size, w, i) for i, w in enumerate(group_windows)]
        self.group_windows = tuple(group_windows)
        self._windowed = [g for g in self.groups if g.window is not None]
        self.swap_space = SwapSpace(num_cpu_blocks)
        # A swapped-out request's table layout: per group, its FREED entries and its live blocks (whose
        # K/V are the request's CPU blocks, in group order).
        self._swapped_layout: dict[str, list[tuple[int, int]]] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _empty(self) -> GroupBlockIds:
        return tuple([] for _ in self.groups)

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """One group's table as the runner sees it (a FREED entry reads as block 0)."""
        return self.groups[group].block_ids(request_id)

    def block_tables(self, request_id: str) -> GroupBlockIds:
        return tuple(g.block_ids(request_id) for g in self.groups)

    def blocks_needed(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one request of num_tokens tokens holds at once, `chunk` tokens computed a step."""
        return request_blocks(self.group_windows, num_tokens, chunk, self.block_size)

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained hashes over any newly full blocks of its tokens."""
        if not self.enable_caching:
            return
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.token_ids_slice(i * bs, (i + 1) * bs)))

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest cached prefix of full blocks that every group has, leaving at least one token to
        compute for logits: (each group's hit blocks, the tokens they cover)."""
        # Prompt logprobs need the logits of every prompt token, so nothing may be skipped (as vLLM).
        if not self.enable_caching or getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return self._empty(), 0
        self.update_block_hashes(request)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        found = [None] * len(self.groups)
        for i, g in enumerate(self.groups):  # full groups first: they bound the hit
            if g.window is None:
                found[i] = g.lookup(hashes)
                hashes = hashes[:len(found[i])]
        best = len(hashes)
        if self._windowed:
            ok = [True] * (best + 1)
            for i, g in enumerate(self.groups):
                if g.window is not None:
                    found[i] = g.lookup(hashes)
                    ok = [a and b for a, b in zip(ok, g.hit_lengths(found[i]))]
            best = max(n for n, fits in enumerate(ok) if fits)
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += best * self.block_size
        return tuple(g.hits(f, best) for g, f in zip(self.groups, found)), best * self.block_size

    def shared_blocks(self, source_id: str, num_blocks: int) -> GroupBlocks | None:
        """The first `num_blocks` blocks of another request's tables (n > 1 samples of one prompt), to be
        taken by allocate_slots like prefix hits (ref count +1, no copy); prefix caching on or off. None
        when the source has already freed blocks inside the window of the taker's first query."""
        shared = tuple(g.shared(source_id, num_blocks) for g in self.groups)
        return None if any(s is None for s in shared) else shared

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> GroupBlockIds | None:
        """Blocks for `num_new_tokens` more tokens, plus `num_lookahead_tokens` slots after them (draft
        tokens to verify: never published in the prefix cache, since they may be rejected); returns the
        newly added block ids of each group, or None if full.

        `new_computed_blocks` are prefix-cache hits (one list per group) found for a request being
        admitted; they are only taken (ref count +1) if the whole allocation succeeds.
        """
        rid = request.request_id
        first = self.groups[0]
        known = rid in first.req_to_blocks
        if self._windowed and known:
            for g in self._windowed:
                g.free_outside_window(rid, request.num_computed_tokens)
        hits = new_computed_blocks
        if not hits or not hits[0]:
            hits = None
            # Fast path, most decode steps: the last block still has room and no block fills up (every
            # group's table has the same length and the same published prefix).
            if known:
                end = request.num_computed_tokens + num_new_tokens
                if end + num_lookahead_tokens <= len(first.req_to_blocks[rid]) * self.block_size and (
                    not self.enable_caching or min(end, request.num_tokens) // self.block_size <= first.num_cached(rid)
                ):
                    return self._empty()
        hits = hits or self._empty()
        num_computed = request.num_computed_tokens + len(hits[0]) * self.block_size
        num_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        needed = sum(g.num_blocks_to_take(rid, num_tokens, h) for g, h in zip(self.groups, hits))
        if needed > self.pool.num_free_blocks:
            return None
        hit_ids = [g.take_hits(rid, h) for g, h in zip(self.groups, hits)]
        new_ids = tuple(ids + g.grow(rid, num_tokens) for g, ids in zip(self.groups, hit_ids))
        if self.enable_caching:
            self.update_block_hashes(request)
            for g in self.groups:
                g.cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        for g in self._windowed:  # hits (shared or cached) left of the first query's window
            g.free_outside_window(rid, num_computed)
        return new_ids

    def trim(self, request: Request) -> int | None:
        """Frees the blocks past the request's computed tokens (slots of rejected draft tokens); returns
        how many blocks its tables keep, or None if none was freed."""
        rid = request.request_id
        blocks = self.groups[0].req_to_blocks.get(rid)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if not blocks or keep >= len(blocks):
            return None
        for g in self.groups:
            g.trim(rid, keep)
        return keep

    def free(self, request: Request) -> None:
        for g in reversed(self.groups):
            g.free(request.request_id)
        self.swap_space.free(request.request_id)  # aborted while swapped out
        self._swapped_layout.pop(request.request_id, None)

    # ---- swap preemption -------------------------------------------------------------------------
    def num_blocks_held(self, request: Request) -> int:
        """GPU blocks the request holds, over every group (its FREED entries hold none)."""
        return sum(len(g.live_blocks(request.request_id)) for g in self.groups)

    def is_swapped(self, request: Request) -> bool:
        return self.swap_space.holds(request.request_id)

    def can_swap_out(self, request: Request) -> bool:
        n = self.num_blocks_held(request)
        return 0 < n <= self.swap_space.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Moves the request's K/V to CPU blocks and frees its GPU blocks; returns (gpu_block, cpu_block)
        pairs for the runner to copy before the step's forward reuses those GPU blocks. Only live blocks
        travel: a windowed group's FREED entries stay FREED when it comes back."""
        rid = request.request_id
        live = [g.live_blocks(rid) for g in self.groups]
        self._swapped_layout[rid] = [(g.num_freed(rid), len(b)) for g, b in zip(self.groups, live)]
        gpu_ids = [b.block_id for blocks in live for b in blocks]
        cpu_ids = self.swap_space.allocate(rid, len(gpu_ids))
        for g in reversed(self.groups):
            g.free(rid)
        return list(zip(gpu_ids, cpu_ids))

    def swap_in(self, request: Request, num_new_tokens: int) -> tuple[list[tuple[int, int]], GroupBlockIds] | None:
        """Fresh GPU blocks for a swapped-out request's K/V, plus room for `num_new_tokens` more; returns
        ((gpu_block, cpu_block) pairs to copy back, the request's whole new block tables), or None if the
        GPU blocks are not free. Its CPU blocks are free once the copy is queued (steps run in order)."""
        rid = request.request_id
        layout = self._swapped_layout[rid]
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if sum(max(total - num_freed, num_live) for num_freed, num_live in layout) > self.pool.num_free_blocks:
            return None
        cpu_ids = self.swap_space.req_to_blocks[rid]
        blocks = self.pool.allocate(len(cpu_ids))
        pairs = [(b.block_id, c) for b, c in zip(blocks, cpu_ids)]
        start = 0
        for g, (num_freed, num_live) in zip(self.groups, layout):
            g.restore(rid, num_freed, blocks[start:start + num_live])
            start += num_live
        self.swap_space.free(rid)
        del self._swapped_layout[rid]
        new_ids = self.allocate_slots(request, num_new_tokens)
        assert new_ids is not None  # checked above
        # Blocks already behind a window were freed again: nothing to copy into them.
        live = {b.block_id for g in self.groups for b in g.live_blocks(rid)}
        return [pair for pair in pairs if pair[0] in live], self.block_tables(rid)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Every block's ref count equals the number of request tables that hold it; every group of a
        request has a table of the same length."""
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for g in self.groups:
            g.check_invariants(holders)
            assert g.req_to_blocks.keys() == self.groups[0].req_to_blocks.keys(), "a request missing a group"
            for rid, blocks in g.req_to_blocks.items():
                assert len(blocks) == len(self.groups[0].req_to_blocks[rid]), "group tables out of step"
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
        self.swap_space.check_invariants()
        swapped = set(self.swap_space.req_to_blocks)
        assert swapped.isdisjoint(self.groups[0].req_to_blocks), "request on GPU and CPU"
        assert swapped == set(self._swapped_layout), "swap layout out of step"
        for rid, layout in self._swapped_layout.items():
            assert sum(n for _, n in layout) == len(self.swap_space.req_to_blocks[rid])
