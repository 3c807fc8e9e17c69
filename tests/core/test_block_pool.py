"""BlockPool unit tests: ref counts, LRU free queue, prefix-cache index, and the no-torch rule."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.core.block_pool import NONE_HASH, BlockPool, hash_block_tokens


def free_order(pool: BlockPool) -> list[int]:
    """Free queue front to back (= eviction order)."""
    return list(pool._free)


def h(tokens, parent=None) -> bytes:
    return hash_block_tokens(parent, tokens)


# ---- the core never imports torch ------------------------------------------------------------------


def test_core_imports_without_torch():
    code = (
        "import sys\n"
        "import kvserve.core, kvserve.core.block_pool, kvserve.core.kv_cache_manager\n"
        "import kvserve.core.request, kvserve.core.scheduler\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


# ---- construction ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -1])
def test_num_blocks_must_be_positive(n):
    with pytest.raises(ValueError):
        BlockPool(n)


def test_fresh_pool_all_free_in_id_order():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    assert free_order(pool) == [0, 1, 2, 3, 4]
    assert pool.usage() == 0.0
    pool.check_invariants()


# ---- allocation / LRU ------------------------------------------------------------------------------


def test_allocate_takes_from_front_and_sets_ref():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage() == pytest.approx(0.75)
    pool.check_invariants()


def test_lru_blocks_freed_later_are_evicted_later():
    pool = BlockPool(4)
    b = pool.allocate(4)
    pool.free([b[2]])
    pool.free([b[0]])
    pool.free([b[3], b[1]])
    assert free_order(pool) == [2, 0, 3, 1]
    got = [pool.allocate(1)[0].block_id for _ in range(4)]
    assert got == [2, 0, 3, 1]
    pool.check_invariants()


def _allocate_cached(pool: BlockPool, n: int):
    """n held blocks, block i published under the hash of tokens [i]; (blocks, hashes)."""
    blocks = pool.allocate(n)
    hashes = [h([i]) for i in range(n)]
    for blk, hh in zip(blocks, hashes):
        pool.cache_block(blk, hh)
    return blocks, hashes


def test_lru_evicts_cached_blocks_oldest_first():
    pool = BlockPool(3)
    b, hashes = _allocate_cached(pool, 3)
    # Free in the order 1, 2, 0: 1 is least recently used.
    pool.free([b[1]])
    pool.free([b[2]])
    pool.free([b[0]])
    assert all(pool.lookup(hh) is not None for hh in hashes)  # free but still cached
    (victim,) = pool.allocate(1)
    assert victim.block_id == 1
    assert victim.block_hash is None
    assert pool.lookup(hashes[1]) is None
    assert pool.lookup(hashes[2]).block_id == 2 and pool.lookup(hashes[0]).block_id == 0
    assert pool.num_evictions == 1
    (victim,) = pool.allocate(1)
    assert victim.block_id == 2 and pool.lookup(hashes[2]) is None
    assert pool.num_evictions == 2
    pool.check_invariants()


def test_allocate_too_many_raises_and_changes_nothing():
    pool = BlockPool(4)
    held = pool.allocate(2)
    pool.cache_block(held[0], h([7]))
    pool.free([held[0]])
    before = (free_order(pool), [b.ref_cnt for b in pool.blocks], dict(pool._cached))
    with pytest.raises(RuntimeError):
        pool.allocate(4)
    assert (free_order(pool), [b.ref_cnt for b in pool.blocks], dict(pool._cached)) == before
    assert pool.lookup(h([7])) is held[0]
    pool.check_invariants()


def test_allocate_zero():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


# ---- ref counts / free -----------------------------------------------------------------------------


def test_double_free_raises():
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([blk])
    assert blk.ref_cnt == 0
    assert free_order(pool) == [1, 0]
    pool.check_invariants()


def test_free_of_never_allocated_block_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.free([pool.blocks[0]])
    pool.check_invariants()


def test_shared_block_returns_to_queue_only_at_zero():
    pool = BlockPool(3)
    (blk,) = pool.allocate(1)
    pool.cache_block(blk, h([1, 2]))
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in pool._free
    pool.free([blk])
    assert blk.ref_cnt == 0 and free_order(pool)[-1] == blk.block_id
    pool.check_invariants()


# ---- prefix cache ----------------------------------------------------------------------------------


def test_touch_revives_cached_free_block():
    pool = BlockPool(3)
    (blk,) = pool.allocate(1)
    hh = h([5, 6])
    pool.cache_block(blk, hh)
    pool.free([blk])
    assert pool.num_free_blocks == 3
    hit = pool.lookup(hh)
    assert hit is blk
    pool.touch([hit])
    assert blk.ref_cnt == 1
    assert blk.block_id not in pool._free
    assert pool.num_free_blocks == 2
    # Allocating everything else never hands the revived block out again.
    others = pool.allocate(2)
    assert blk.block_id not in {b.block_id for b in others}
    assert pool.lookup(hh) is blk
    pool.check_invariants()


def test_cache_block_disabled_is_noop():
    pool = BlockPool(2, enable_caching=False)
    (blk,) = pool.allocate(1)
    pool.cache_block(blk, h([1]))
    assert blk.block_hash is None and pool.lookup(h([1])) is None


def test_duplicate_hash_stays_unpublished():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    hh = h([1, 1])
    pool.cache_block(a, hh)
    pool.cache_block(b, hh)
    assert pool.lookup(hh) is a
    assert b.block_hash is None
    # Re-caching an already-cached block under another hash does not move it.
    pool.cache_block(a, h([2, 2]))
    assert a.block_hash == hh and pool.lookup(h([2, 2])) is None
    pool.check_invariants()


def test_evicting_duplicate_does_not_drop_original_entry():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    hh = h([3])
    pool.cache_block(a, hh)
    pool.free([b])
    pool.allocate(1)  # evicts b (never published): a stays the entry
    assert pool.lookup(hh) is a
    pool.check_invariants()


def test_hash_chaining():
    toks = [1, 2, 3, 4]
    p1, p2 = h([0, 0, 0, 0]), h([0, 0, 0, 1])
    assert h(toks, p1) != h(toks, p2)
    assert h(toks, p1) == h(toks, p1)  # deterministic
    assert h(toks) != h(toks, p1)
    assert h(toks) == h(toks, NONE_HASH)  # no parent == the all-zero parent
    assert h([1, 2]) != h([2, 1])
    assert h([1, 2]) != h([1, 2, 0])
    assert hash_block_tokens(None, toks, b"lora") != h(toks)
    assert len(h(toks)) == 32


def test_reset_prefix_cache():
    pool = BlockPool(3)
    blocks, hashes = _allocate_cached(pool, 2)
    pool.free([blocks[1]])
    # A block is still held: refused, nothing dropped.
    assert pool.reset_prefix_cache() is False
    assert all(pool.lookup(hh) is not None for hh in hashes)
    pool.free([blocks[0]])
    assert pool.reset_prefix_cache() is True
    assert all(pool.lookup(hh) is None for hh in hashes)
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 3
    pool.check_invariants()
    # Allocation after reset counts no evictions (nothing was cached).
    n_ev = pool.num_evictions
    pool.allocate(3)
    assert pool.num_evictions == n_ev
