"""One KV cache group's block table per request, on the block pool every group shares.

Every group's table of a request has the same length (one entry per block of positions), so positions
line up across groups. In a windowed group the entries wholly left of the window of the next query are
FREED as the request advances (position kept, no reference held; the runner's copy of the id is never
read again): they always form a prefix of the table. Prefix-cache entries are per group (the same tokens
have one block in each group), keyed by the block hash and the group's index.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.block_pool import BlockPool, KVBlock
from kvserve.core.request import Request
from kvserve.units import cdiv

FREED = KVBlock(-1)  # a table entry whose block left the sliding window: holds no reference


def first_block_in_window(first_query_pos: int, block_size: int, sliding_window: int | None) -> int:
    """Index of the first block a query at first_query_pos (or later) can see; earlier ones may be freed."""
    if sliding_window is None:
        return 0
    return max(0, first_query_pos - sliding_window + 1) // block_size


def runner_id(block: KVBlock) -> int:
    """A FREED entry reads as block 0 for the runner (never read: it is outside every window)."""
    return 0 if block is FREED else block.block_id


class GroupBlockTables:
    def __init__(self, pool: BlockPool, block_size: int, window: int | None, index: int):
        self.pool = pool
        self.block_size = block_size
        self.window = window
        self._key_suffix = b"" if index == 0 else index.to_bytes(4, "little")
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each table are published in the prefix cache, and (windowed) FREED.
        self._num_cached_blocks: dict[str, int] = {}
        self._num_freed: dict[str, int] = {}

    def key(self, block_hash: bytes) -> bytes:
        return block_hash + self._key_suffix

    def block_ids(self, request_id: str) -> list[int]:
        return [runner_id(b) for b in self.req_to_blocks.get(request_id, ())]

    def live_blocks(self, request_id: str) -> list[KVBlock]:
        return [b for b in self.req_to_blocks.get(request_id, ()) if b is not FREED]

    def num_freed(self, request_id: str) -> int:
        return self._num_freed.get(request_id, 0)

    def num_cached(self, request_id: str) -> int:
        return self._num_cached_blocks.get(request_id, 0)

    # ---- prefix-cache hits -----------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[bytes]) -> list[KVBlock | None]:
        """This group's cached block of each hash. A full group needs an unbroken prefix, so its lookup
        stops at the first miss; a windowed one looks at them all (its hit may skip evicted old blocks)."""
        found: list[KVBlock | None] = []
        for block_hash in block_hashes:
            block = self.pool.lookup(self.key(block_hash))
            if block is None and self.window is None:
                break
            found.append(block)
        return found

    def hit_lengths(self, found: list[KVBlock | None]) -> list[bool]:
        """ok[n]: a hit of n blocks has every block this group reads (those inside the window of
        position n * block_size), n = 0 .. len(found)."""
        if self.window is None:
            return [True] * (len(found) + 1)
        ok, run = [True], 0  # run: cached blocks in a row ending at block n - 1
        for n, block in enumerate(found, start=1):
            run = run + 1 if block is not None else 0
            ok.append(run >= n - first_block_in_window(n * self.block_size, self.block_size, self.window))
        return ok

    def hits(self, found: list[KVBlock | None], n: int) -> list[KVBlock]:
        """The table prefix of a hit of n blocks: FREED placeholders for the blocks left of the window."""
        first = first_block_in_window(n * self.block_size, self.block_size, self.window)
        return [FREED] * first + found[first:n]

    def shared(self, source_id: str, num_blocks: int) -> list[KVBlock] | None:
        """The first `num_blocks` of another request's table (n > 1 samples of one prompt), or None when
        it has freed blocks inside the window of the taker's first query."""
        blocks = self.req_to_blocks[source_id][:num_blocks]
        first = first_block_in_window(num_blocks * self.block_size, self.block_size, self.window)
        return None if any(b is FREED for b in blocks[first:]) else blocks

    # ---- allocation --------------------------------------------------------------------------------
    def num_blocks_to_take(self, request_id: str, num_tokens: int, hits: list[KVBlock]) -> int:
        """Free-queue blocks that growing the table to `num_tokens` positions with `hits` takes: new blocks
        and hits that sit in the free queue (no longer allocatable once taken)."""
        held = len(self.req_to_blocks.get(request_id, ())) + len(hits)
        revived = sum(1 for b in hits if b.ref_cnt == 0 and b is not FREED)
        return max(0, cdiv(num_tokens, self.block_size) - held) + revived

    def take_hits(self, request_id: str, hits: list[KVBlock]) -> list[int]:
        """Appends the hits (ref count +1); returns their ids. Every group takes its hits before any
        allocates: an allocation may evict a cached block that is still free, another group's hit."""
        self.pool.touch([b for b in hits if b is not FREED])
        self.req_to_blocks.setdefault(request_id, []).extend(hits)
        return [runner_id(b) for b in hits]

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Appends new blocks up to `num_tokens` positions; returns their ids. The caller checked that the
        pool has them (num_blocks_to_take)."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        new_blocks = self.pool.allocate(max(0, cdiv(num_tokens, self.block_size) - len(blocks)))
        blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def free_outside_window(self, request_id: str, first_query_pos: int) -> None:
        """Free the table's blocks that no query from first_query_pos on can see, oldest first (so the
        prefix cache evicts them before the window's blocks)."""
        if self.window is None:
            return
        blocks = self.req_to_blocks[request_id]
        start = self._num_freed.get(request_id, 0)
        end = min(first_block_in_window(first_query_pos, self.block_size, self.window), len(blocks))
        if end <= start:
            return
        dead = [b for b in blocks[start:end] if b is not FREED]
        blocks[start:end] = [FREED] * (end - start)
        self._num_freed[request_id] = end
        self.pool.free(dead)

    def cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        """Publishes the blocks filled by the end of this step: any reader is in a later step, or in this
        step's batch where all K/V writes of a layer precede its attention."""
        blocks = self.req_to_blocks[request.request_id]
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = num_tokens_after_step // self.block_size
        for i in range(start, end):
            if blocks[i] is not FREED:  # a freed entry was published before it left the window
                self.pool.cache_block(blocks[i], self.key(request.block_hashes[i]))
        self._num_cached_blocks[request.request_id] = max(start, end)

    def trim(self, request_id: str, keep: int) -> None:
        """Frees the blocks from entry `keep` on (rejected drafts' slots; freed entries lie before keep)."""
        blocks = self.req_to_blocks[request_id]
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free([b for b in reversed(tail) if b is not FREED])

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        self._num_freed.pop(request_id, None)
        # Tail first, so a shared prefix is the last to be evicted.
        self.pool.free([b for b in reversed(blocks) if b is not FREED])

    # ---- swap preemption -------------------------------------------------------------------------
    def restore(self, request_id: str, num_freed: int, blocks: list[KVBlock]) -> None:
        """A swapped-in table: its FREED prefix, then fresh blocks for its live entries."""
        self.req_to_blocks[request_id] = [FREED] * num_freed + blocks
        if num_freed:
            self._num_freed[request_id] = num_freed

    def check_invariants(self, holders: list[int]) -> None:
        """Adds each live block's holders; checks the FREED entries form the recorded prefix."""
        for rid, blocks in self.req_to_blocks.items():
            live = [b for b in blocks if b is not FREED]
            assert len({b.block_id for b in live}) == len(live), "block twice in one table"
            for b in live:
                holders[b.block_id] += 1
            num_freed = len(blocks) - len(live)
            if self.window is None:
                assert num_freed == 0, "a freed entry without a sliding window"
            assert all(b is FREED for b in blocks[:num_freed]), "freed entries after a live one"
