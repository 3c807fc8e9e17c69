"""KVCacheManager with a sliding window: blocks wholly left of the next query's window are freed as a
request advances (so a long request holds about window + one block), and a prefix hit needs only the
blocks inside the window of its first computed token."""

from __future__ import annotations

from kvserve.core.kv_cache_manager import FREED, KVCacheManager, first_block_in_window
from tests.core.test_kv_cache_manager import admit, req

BS = 4


def decode(kv: KVCacheManager, r, token: int = 7) -> list[int]:
    """One decode step: the scheduler's allocate, then the sampled token appended."""
    ids = kv.allocate_slots(r, 1)
    assert ids is not None
    r.num_computed_tokens += 1
    r.append_output_token(token)
    return ids


def live_blocks(kv: KVCacheManager, rid: str) -> list[int]:
    return [b.block_id for b in kv.groups[0].req_to_blocks[rid] if b is not FREED]


def test_first_block_in_window():
    assert first_block_in_window(100, 4, None) == 0
    assert first_block_in_window(10, 4, 8) == 0  # positions 3.. visible: block 0 still needed
    assert first_block_in_window(12, 4, 8) == 1  # positions 5..: block 1 (4-7) is the first
    assert first_block_in_window(13, 4, 8) == 1
    assert first_block_in_window(9, 4, 1) == 2  # a window of one: only the query's own block


def test_long_request_holds_only_its_window():
    kv = KVCacheManager(8, BS, enable_caching=False, group_windows=[6])
    r = req("a", range(10, 20))  # 10 tokens: 3 blocks
    admit(kv, r)
    assert len(live_blocks(kv, "a")) == 3
    for _ in range(40):  # 50 tokens in all: 13 blocks without the window, in an 8-block pool
        decode(kv, r)
        table = kv.groups[0].req_to_blocks["a"]
        first = first_block_in_window(r.num_computed_tokens - 1, BS, 6)
        assert all(b is FREED for b in table[:first]) and all(b is not FREED for b in table[first:])
        assert len(live_blocks(kv, "a")) <= 6 // BS + 2
        kv.check_invariants()
    assert len(kv.groups[0].req_to_blocks["a"]) == -(-r.num_computed_tokens // BS)
    kv.free(r)
    assert kv.pool.num_free_blocks == 8
    kv.check_invariants()


def test_without_window_nothing_is_freed():
    kv = KVCacheManager(16, BS, enable_caching=False)
    r = req("a", range(10, 20))
    admit(kv, r)
    for _ in range(20):
        decode(kv, r)
    assert FREED not in kv.groups[0].req_to_blocks["a"]


def test_windowed_prefix_hit_needs_only_the_window():
    kv = KVCacheManager(32, BS, group_windows=[6])
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks
    a = req("a", prompt)
    admit(kv, a)
    kv.free(a)
    # Evict the first three cached blocks (blocks 0-2), as if reused by others.
    for h in a.block_hashes[:3]:
        kv.pool._evict(kv.pool.lookup(h))
    b = req("b", prompt + [1, 2, 3])
    (hits,), n_hit = kv.get_computed_blocks(b)
    # Without a window the chain would break at block 0; with one, 7 blocks hit and only the window of
    # position 28 (positions 23.. : blocks 5 and 6) is taken.
    assert n_hit == 7 * BS
    first = first_block_in_window(n_hit, BS, 6)
    assert all(h is FREED for h in hits[:first]) and all(h is not FREED for h in hits[first:])
    ids = kv.allocate_slots(b, b.num_tokens - n_hit, [hits])
    assert ids is not None and ids[0][:first] == [0] * first
    b.num_computed_tokens = b.num_tokens
    kv.check_invariants()
    kv.free(b)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 32


def test_hit_with_a_hole_inside_the_window_is_shorter():
    kv = KVCacheManager(32, BS, group_windows=[6])
    prompt = list(range(100, 130))
    a = req("a", prompt)
    admit(kv, a)
    kv.free(a)
    kv.pool._evict(kv.pool.lookup(a.block_hashes[5]))  # a hole at block 5
    (hits,), n_hit = kv.get_computed_blocks(req("b", prompt + [1]))
    # 7 blocks would need block 5; 6 blocks need blocks 4-5 (positions 19..); 5 blocks need 3-4.
    assert n_hit == 5 * BS
