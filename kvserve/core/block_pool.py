"""Fixed-size KV blocks: reference counts, an LRU free queue, and the prefix-cache index.

A block with ref_cnt 0 sits in the free queue. If it also carries a hash it is still a valid
prefix-cache entry: a later request may revive it (touch) until allocation evicts it, oldest first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

NONE_HASH = b"\x00" * 32


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """sha256 chained over the parent block's hash, so equal hashes imply equal whole prefixes."""
    h = hashlib.sha256(parent_hash or NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(extra_keys)
    return h.digest()


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order = eviction order (front is least recently freed).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by some request (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    # ---- allocation ------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference each; callers pass blocks tail-first so prefixes outlive suffixes."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                # Keeps its hash: it stays a prefix-cache hit until allocate() evicts it.
                self._free[block.block_id] = None

    # ---- prefix cache ----------------------------------------------------------------------------
    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full block under its hash; a duplicate of an existing entry stays unpublished."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block.block_id

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Drop every cache entry; only possible when no request holds a block."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    # ---- invariants (used by tests) --------------------------------------------------------------
    def check_invariants(self) -> None:
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in self._free), block
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash
