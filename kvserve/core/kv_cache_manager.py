"""Per-request block tables on top of the block pool: prefix-cache lookup, slot allocation, freeing.

With a sliding window (a model whose every layer attends to its last W positions only), a table's
blocks that lie wholly left of the window of the next query are freed as the request advances, and
prefix hits need only the blocks inside the window of the first computed token. A freed entry is
FREED in the table (position kept; the runner's copy of the id is never read again).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from kvserve.core.request import Request
from kvserve.core.swap_space import SwapSpace
from kvserve.units import cdiv  # noqa: F401 - the scheduler and tests read it from here


FREED = KVBlock(-1)  # a table entry whose block left the sliding window: holds no reference


def first_block_in_window(first_query_pos: int, block_size: int, sliding_window: int | None) -> int:
    """Index of the first block a query at first_query_pos (or later) can see; earlier ones may be freed."""
    if sliding_window is None:
        return 0
    return max(0, first_query_pos - sliding_window + 1) // block_size


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_cpu_blocks: int = 0,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.sliding_window = sliding_window
        # How many leading entries of each table are FREED (only with a sliding window).
        self._num_freed: dict[str, int] = {}
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.swap_space = SwapSpace(num_cpu_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already published in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        """The runner's view: a FREED entry reads as block 0 (never read: it is outside every window)."""
        return [_runner_id(b) for b in self.req_to_blocks.get(request_id, ())]

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained hashes over any newly full blocks of its tokens."""
        if not self.enable_caching:
            return
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.token_ids_slice(i * bs, (i + 1) * bs)))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute for logits."""
        # Prompt logprobs need the logits of every prompt token, so nothing may be skipped (as vLLM).
        if not self.enable_caching or getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return [], 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is None:
            hits: list[KVBlock] = []
            for block_hash in request.block_hashes[:max_hit_blocks]:
                block = self.pool.lookup(block_hash)
                if block is None:
                    break
                hits.append(block)
        else:
            hits = self._windowed_hits(request.block_hashes[:max_hit_blocks])
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def _windowed_hits(self, block_hashes: list[bytes]) -> list[KVBlock]:
        """The longest hit of n blocks whose window is cached: blocks first_block_in_window(n * bs) .. n - 1
        must be in the cache; the earlier ones are FREED placeholders (evicted or not, never read)."""
        bs = self.block_size
        found = [self.pool.lookup(h) for h in block_hashes]
        best, run = 0, 0  # run: cached blocks in a row ending at block i
        for i, block in enumerate(found):
            run = run + 1 if block is not None else 0
            n = i + 1
            if run >= n - first_block_in_window(n * bs, bs, self.sliding_window):
                best = n
        first = first_block_in_window(best * bs, bs, self.sliding_window)
        return [FREED] * first + found[first:best]

    def shared_blocks(self, source_id: str, num_blocks: int) -> list[KVBlock] | None:
        """The first `num_blocks` blocks of another request's table (n > 1 samples of one prompt), to be
        taken by allocate_slots like prefix hits (ref count +1, no copy); prefix caching on or off. None
        when the source has already freed blocks inside the window of the taker's first query."""
        blocks = self.req_to_blocks[source_id][:num_blocks]
        first = first_block_in_window(num_blocks * self.block_size, self.block_size, self.sliding_window)
        if any(b is FREED for b in blocks[first:]):
            return None
        return blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens, plus `num_lookahead_tokens` slots after them (draft
        tokens to verify: never published in the prefix cache, since they may be rejected); returns the
        newly added block ids, or None if full.

        `new_computed_blocks` are prefix-cache hits found for a request being admitted; they are
        only taken (ref count +1) if the whole allocation succeeds.
        """
        if self.sliding_window is not None and request.request_id in self.req_to_blocks:
            self._free_outside_window(request.request_id, request.num_computed_tokens)
        if not new_computed_blocks:
            # Fast path, most decode steps: the last block still has room and no block fills up.
            blocks = self.req_to_blocks.get(request.request_id)
            if blocks is not None:
                end = request.num_computed_tokens + num_new_tokens
                if end + num_lookahead_tokens <= len(blocks) * self.block_size and (
                    not self.enable_caching
                    or min(end, request.num_tokens) // self.block_size <= self._num_cached_blocks.get(request.request_id, 0)
                ):
                    return []
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # Hits that sit in the free queue stop being allocatable once we take them.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not FREED)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch([b for b in new_computed_blocks if b is not FREED])
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        if self.sliding_window is not None:  # hits (shared or cached) left of the first query's window
            self._free_outside_window(request.request_id, num_computed)
        return [_runner_id(b) for b in new_computed_blocks] + [b.block_id for b in new_blocks]

    def _free_outside_window(self, request_id: str, first_query_pos: int) -> None:
        """Free the table's blocks that no query from first_query_pos on can see, oldest first (so the
        prefix cache evicts them before the window's blocks)."""
        blocks = self.req_to_blocks[request_id]
        start = self._num_freed.get(request_id, 0)
        end = min(first_block_in_window(first_query_pos, self.block_size, self.sliding_window), len(blocks))
        if end <= start:
            return
        dead = [b for b in blocks[start:end] if b is not FREED]
        blocks[start:end] = [FREED] * (end - start)
        self._num_freed[request_id] = end
        self.pool.free(dead)

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        # Published now, computed by the end of this step: any reader is in a later step, or in this
        # step's batch where all K/V writes of a layer precede its attention.
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = num_tokens_after_step // self.block_size
        for i in range(start, end):
            if blocks[i] is not FREED:  # a freed entry was published before it left the window
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def trim(self, request: Request) -> int | None:
        """Frees the blocks past the request's computed tokens (slots of rejected draft tokens); returns
        how many blocks its table keeps, or None if none was freed."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if not blocks or keep >= len(blocks):
            return None
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free([b for b in reversed(tail) if b is not FREED])  # (freed entries lie before keep)
        return keep

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_freed.pop(request.request_id, None)
        # Tail first, so a shared prefix is the last to be evicted.
        self.pool.free([b for b in reversed(blocks) if b is not FREED])
        self.swap_space.free(request.request_id)  # aborted while swapped out

    # ---- swap preemption -------------------------------------------------------------------------
    def num_blocks_held(self, request: Request) -> int:
        return len(self.req_to_blocks.get(request.request_id, ()))

    def is_swapped(self, request: Request) -> bool:
        return self.swap_space.holds(request.request_id)

    def can_swap_out(self, request: Request) -> bool:
        # A table with freed entries is recomputed instead (its swap-in would need the FREED positions kept).
        if self._num_freed.get(request.request_id) or FREED in self.req_to_blocks.get(request.request_id, ()):
            return False
        n = self.num_blocks_held(request)
        return 0 < n <= self.swap_space.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Moves the request's K/V to CPU blocks and frees its GPU blocks; returns (gpu_block, cpu_block)
        pairs for the runner to copy before the step's forward reuses those GPU blocks."""
        gpu_ids = self.block_ids(request.request_id)
        cpu_ids = self.swap_space.allocate(request.request_id, len(gpu_ids))
        blocks = self.req_to_blocks.pop(request.request_id)
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(blocks[::-1])
        return list(zip(gpu_ids, cpu_ids))

    def swap_in(self, request: Request, num_new_tokens: int) -> tuple[list[tuple[int, int]], list[int]] | None:
        """Fresh GPU blocks for a swapped-out request's K/V, plus room for `num_new_tokens` more; returns
        ((gpu_block, cpu_block) pairs to copy back, the request's whole new block table), or None if the
        GPU blocks are not free. Its CPU blocks are free once the copy is queued (steps run in order)."""
        cpu_ids = self.swap_space.req_to_blocks[request.request_id]
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if max(total, len(cpu_ids)) > self.pool.num_free_blocks:
            return None
        blocks = self.pool.allocate(len(cpu_ids))
        self.req_to_blocks[request.request_id] = list(blocks)
        pairs = [(b.block_id, c) for b, c in zip(blocks, cpu_ids)]
        self.swap_space.free(request.request_id)
        new_ids = self.allocate_slots(request, num_new_tokens)
        assert new_ids is not None  # checked above
        # With a sliding window, blocks already behind it were freed again: nothing to copy into them.
        table = self.req_to_blocks[request.request_id]
        pairs = [pair for i, pair in enumerate(pairs) if table[i] is not FREED]
        return pairs, self.block_ids(request.request_id)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Every block's ref count equals the number of request tables that hold it."""
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for rid, blocks in self.req_to_blocks.items():
            live = [b for b in blocks if b is not FREED]
            assert len({b.block_id for b in live}) == len(live), "block twice in one table"
            for b in live:
                holders[b.block_id] += 1
            if self.sliding_window is None:
                assert len(live) == len(blocks), "a freed entry without a sliding window"
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
        self.swap_space.check_invariants()
        assert set(self.swap_space.req_to_blocks).isdisjoint(self.req_to_blocks), "request on GPU and CPU"


def _runner_id(block: KVBlock) -> int:
    return 0 if block is FREED else block.block_id
