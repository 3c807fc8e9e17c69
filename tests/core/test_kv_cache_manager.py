"""KVCacheManager unit tests: block tables, prefix-cache hits, allocation failure, freeing order."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvserve.core.block_pool import hash_block_tokens
from kvserve.core.kv_cache_manager import KVCacheManager, cdiv
from kvserve.core.request import Request

BS = 4


@dataclass
class Params:
    max_tokens: int = 16
    ignore_eos: bool = True
    min_tokens: int = 0
    stop_token_ids: list = field(default_factory=list)


def req(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), Params())


def admit(kv: KVCacheManager, r: Request):
    """What the scheduler does to admit a request and compute its whole prompt in one step."""
    hits, n_hit = kv.get_computed_blocks(r)
    ids = kv.allocate_slots(r, r.num_tokens - n_hit, hits)
    if ids is None:
        return None
    r.num_computed_tokens = r.num_tokens
    return hits[0], n_hit, ids[0]  # the one KV cache group's


def state(kv: KVCacheManager):
    pool = kv.pool
    return (
        list(pool._free),
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        dict(pool._cached),
        {k: [b.block_id for b in v] for k, v in kv.groups[0].req_to_blocks.items()},
        dict(kv.groups[0]._num_cached_blocks),
    )


def test_cdiv():
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_and_free_fresh_request():
    kv = KVCacheManager(8, BS)
    r = req("a", range(10))
    hits, n_hit, ids = admit(kv, r)
    assert hits == [] and n_hit == 0
    assert ids == [0, 1, 2] and kv.block_ids("a") == [0, 1, 2]
    assert kv.pool.num_free_blocks == 5
    kv.check_invariants()
    kv.free(r)
    assert kv.pool.num_free_blocks == 8 and kv.block_ids("a") == []
    kv.check_invariants()


def test_allocate_slots_grows_only_at_block_boundary():
    kv = KVCacheManager(8, BS)
    r = req("a", range(3))
    admit(kv, r)
    assert kv.block_ids("a") == [0]
    for tok, expect_new in [(100, []), (101, [1]), (102, []), (103, []), (104, []), (105, [2])]:
        r.append_output_token(tok)
        # decode: compute the one newest token (position num_tokens - 1)
        new = kv.allocate_slots(r, r.num_tokens - r.num_computed_tokens)
        assert new == (expect_new,)
        r.num_computed_tokens = r.num_tokens
        assert len(kv.block_ids("a")) * BS >= r.num_tokens
        kv.check_invariants()


def test_prefix_hit_reuses_block_ids_and_bumps_ref_count():
    kv = KVCacheManager(16, BS)
    prompt = list(range(2 * BS + 1))
    a = req("a", prompt)
    admit(kv, a)
    a_ids = kv.block_ids("a")
    b = req("b", prompt)
    hits, n_hit, ids = admit(kv, b)
    assert n_hit == 2 * BS
    assert [blk.block_id for blk in hits] == a_ids[:2]
    assert kv.block_ids("b")[:2] == a_ids[:2]
    assert kv.block_ids("b")[2] != a_ids[2]  # the partial tail is never shared
    assert ids == kv.block_ids("b")  # returned ids = hits + new
    assert [kv.pool.blocks[i].ref_cnt for i in a_ids] == [2, 2, 1]
    assert kv.prefix_cache_stats.hits == 2 * BS
    assert kv.prefix_cache_stats.queries == 2 * len(prompt)
    kv.check_invariants()
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in a_ids] == [1, 1, 0]
    kv.check_invariants()


def test_cached_free_block_is_revived_by_hit():
    kv = KVCacheManager(8, BS)
    prompt = list(range(2 * BS + 1))
    a = req("a", prompt)
    admit(kv, a)
    a_ids = kv.block_ids("a")
    kv.free(a)
    assert kv.pool.num_free_blocks == 8
    b = req("b", prompt)
    hits, n_hit, _ = admit(kv, b)
    assert n_hit == 2 * BS
    assert [blk.block_id for blk in hits] == a_ids[:2]
    for i in a_ids[:2]:
        assert i not in kv.pool._free and kv.pool.blocks[i].ref_cnt == 1
    # 2 revived + 1 new block taken from the free queue
    assert kv.pool.num_free_blocks == 8 - 3
    kv.check_invariants()


def test_only_full_blocks_are_cached():
    kv = KVCacheManager(8, BS)
    r = req("a", range(BS + 2))  # one full block + 2 tokens
    admit(kv, r)
    ids = kv.block_ids("a")
    assert kv.pool.blocks[ids[0]].block_hash is not None
    assert kv.pool.blocks[ids[1]].block_hash is None
    assert len(kv.pool._cached) == 1
    # Decode until the second block fills; it is published once its last token is scheduled.
    r.append_output_token(50)
    kv.allocate_slots(r, 1)
    r.num_computed_tokens += 1
    assert kv.pool.blocks[ids[1]].block_hash is None  # BS + 3 tokens: still partial
    r.append_output_token(51)
    kv.allocate_slots(r, 1)
    r.num_computed_tokens += 1
    assert kv.pool.blocks[ids[1]].block_hash is not None  # BS + 4 = 2 full blocks
    assert len(kv.pool._cached) == 2
    kv.check_invariants()


def test_chunked_prefill_publishes_only_scheduled_full_blocks():
    kv = KVCacheManager(8, BS)
    r = req("a", range(3 * BS))
    kv.allocate_slots(r, BS + 1)  # first chunk: one full block and one token of the next
    assert len(kv.pool._cached) == 1
    r.num_computed_tokens = BS + 1
    kv.allocate_slots(r, 2 * BS - 1)
    assert len(kv.pool._cached) == 3
    kv.check_invariants()


def test_caching_disabled_never_hits():
    kv = KVCacheManager(8, BS, enable_caching=False)
    prompt = list(range(2 * BS + 1))
    admit(kv, req("a", prompt))
    hits, n_hit, _ = admit(kv, req("b", prompt))
    assert hits == [] and n_hit == 0
    assert kv.pool._cached == {}
    assert kv.prefix_cache_stats.queries == 0
    kv.check_invariants()


def test_hash_chaining_same_block_under_different_parent_misses():
    kv = KVCacheManager(16, BS)
    tail = [9, 9, 9, 9]
    a = req("a", [0, 0, 0, 0] + tail + [1])
    admit(kv, a)
    b = req("b", [0, 0, 0, 1] + tail + [1])
    hits, n_hit, _ = admit(kv, b)
    assert hits == [] and n_hit == 0  # first block differs, so the second must not hit either
    assert a.block_hashes[1] != b.block_hashes[1]
    c = req("c", [0, 0, 0, 0] + [9, 9, 9, 8] + [1])
    hits, n_hit, _ = admit(kv, c)
    assert n_hit == BS and [x.block_id for x in hits] == kv.block_ids("a")[:1]
    kv.check_invariants()


def test_block_hashes_are_chained_over_prompt_and_outputs():
    kv = KVCacheManager(16, BS)
    r = req("a", [1, 2, 3, 4, 5, 6])
    r.append_output_token(7)
    r.append_output_token(8)
    kv.update_block_hashes(r)
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert r.block_hashes == [h0, hash_block_tokens(h0, [5, 6, 7, 8])]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_exact_full_blocks_prompt_leaves_one_token_to_compute(k):
    kv = KVCacheManager(16, BS)
    prompt = list(range(k * BS))
    admit(kv, req("a", prompt))
    assert len(kv.pool._cached) == k  # every block of the first copy is cached
    b = req("b", prompt)
    (hits,), n_hit = kv.get_computed_blocks(b)
    assert len(hits) == k - 1 and n_hit == (k - 1) * BS
    ids = kv.allocate_slots(b, b.num_tokens - n_hit, [hits])
    assert ids is not None and len(kv.block_ids("b")) == k
    assert kv.block_ids("b")[-1] != kv.block_ids("a")[-1]
    kv.check_invariants()


def test_single_token_prompt_never_hits():
    kv = KVCacheManager(4, 1)
    admit(kv, req("a", [3]))
    (hits,), n_hit = kv.get_computed_blocks(req("b", [3]))
    assert hits == [] and n_hit == 0


def test_allocation_failure_leaves_state_unchanged_and_hits_not_taken():
    kv = KVCacheManager(4, BS)
    prompt = list(range(2 * BS + 1))
    a = req("a", prompt)
    admit(kv, a)  # 3 blocks
    kv.free(a)  # all free; blocks 0,1 cached
    filler = req("f", [7] * (2 * BS))
    admit(kv, filler)  # takes 2 blocks: evicts a's tail (2) and block 3 (never used)
    kv.check_invariants()
    b = req("b", prompt + [5] * BS)  # 13 tokens: a's 2 cached blocks hit, then 2 new blocks
    (hits,), n_hit = kv.get_computed_blocks(b)
    assert n_hit == 2 * BS and all(x.ref_cnt == 0 for x in hits)
    before = state(kv)
    assert kv.allocate_slots(b, b.num_tokens - n_hit, [hits]) is None
    assert state(kv) == before
    assert "b" not in kv.groups[0].req_to_blocks
    assert all(x.ref_cnt == 0 and x.block_id in kv.pool._free for x in hits)
    kv.check_invariants()
    # With room it succeeds and does take the hits.
    kv.free(filler)
    assert kv.allocate_slots(b, b.num_tokens - n_hit, [hits]) is not None
    assert kv.block_ids("b")[:2] == [x.block_id for x in hits]
    kv.check_invariants()


def test_allocation_failure_counts_revived_hits_against_free_blocks():
    # 3 free blocks, 2 of them cached hits: the request needs 2 hits + 2 new = 4 > 3 free.
    kv = KVCacheManager(4, BS)
    a = req("a", range(2 * BS + 1))
    admit(kv, a)
    held = req("h", [9])
    kv.allocate_slots(held, 1)  # the 4th block
    kv.free(a)
    b = req("b", list(range(2 * BS)) + [6] * (BS + 1))
    (hits,), n_hit = kv.get_computed_blocks(b)
    assert len(hits) == 2
    before = state(kv)
    assert kv.allocate_slots(b, b.num_tokens - n_hit, [hits]) is None
    assert state(kv) == before
    kv.check_invariants()


def test_running_request_allocation_failure_keeps_its_table():
    kv = KVCacheManager(2, BS)
    r = req("a", range(BS))
    admit(kv, r)
    other = req("o", range(100, 100 + BS))
    admit(kv, other)
    r.append_output_token(1)
    before = state(kv)
    assert kv.allocate_slots(r, 1) is None
    assert state(kv) == before and kv.block_ids("a") == [0]
    kv.check_invariants()


def test_free_is_tail_first_so_tail_is_evicted_before_head():
    kv = KVCacheManager(4, BS)
    r = req("a", range(3 * BS + 1))  # 4 blocks, first 3 cached
    admit(kv, r)
    ids = kv.block_ids("a")
    kv.free(r)
    assert list(kv.pool._free) == ids[::-1]
    # Each allocation evicts the current tail; the head survives the longest.
    other = req("o", [8] * BS)
    admit(kv, other)  # 1 block: the uncached partial tail
    assert kv.block_ids("o") == [ids[3]]
    again = req("a2", range(3 * BS + 1))
    (hits,), _ = kv.get_computed_blocks(again)
    assert [x.block_id for x in hits] == ids[:3]
    kv.free(other)
    kv.pool.allocate(1)  # evicts a's last cached block (ids[2]); its head blocks outlive it
    (hits,), _ = kv.get_computed_blocks(again)
    assert [x.block_id for x in hits] == ids[:2]
    kv.pool.allocate(1)
    (hits,), _ = kv.get_computed_blocks(again)
    assert [x.block_id for x in hits] == ids[:1]


def test_double_free_of_request_is_harmless_but_pool_double_free_raises():
    kv = KVCacheManager(4, BS)
    r = req("a", range(5))
    admit(kv, r)
    blocks = list(kv.groups[0].req_to_blocks["a"])
    kv.free(r)
    kv.free(r)  # the table is gone: a second free is a no-op, not a second decrement
    assert kv.pool.num_free_blocks == 4
    kv.check_invariants()
    with pytest.raises(RuntimeError, match="double free"):
        kv.pool.free(blocks)


def test_reset_prefix_cache():
    kv = KVCacheManager(4, BS)
    prompt = list(range(2 * BS + 1))
    a = req("a", prompt)
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    (hits,), n_hit = kv.get_computed_blocks(req("b", prompt))
    assert hits == [] and n_hit == 0
    kv.check_invariants()


def test_shared_prefix_between_three_requests_ref_counts():
    kv = KVCacheManager(16, BS)
    base = list(range(2 * BS))
    rs = [req(f"r{i}", base + [i] * 3) for i in range(3)]
    for r in rs:
        admit(kv, r)
    shared = kv.block_ids("r0")[:2]
    assert all(kv.block_ids(r.request_id)[:2] == shared for r in rs)
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [3, 3]
    kv.check_invariants()
    for n, r in enumerate(rs):
        kv.free(r)
        assert [kv.pool.blocks[i].ref_cnt for i in shared] == [2 - n] * 2
        kv.check_invariants()
    assert kv.pool.num_free_blocks == 16


def test_hit_chain_stops_at_first_missing_block():
    """A later block of a chain can outlive its head: A computes a duplicate of D's head (left
    unpublished) and publishes its own second block on top of it; once D's head is evicted the
    lookup must stop at the miss, not return A's second block as if it were at position 0."""
    kv = KVCacheManager(8, BS)
    X, Y, Z = [0, 1, 2, 3], [1, 1, 1, 1], [2, 2, 2, 2]
    a = req("a", X + Z + [3])
    assert kv.allocate_slots(a, 2) == ([0],)  # first chunk: block 0 still partial, unpublished
    a.num_computed_tokens = 2
    d = req("d", X + Y + [3])
    assert admit(kv, d)[1] == 0  # no hit: a's head is not published yet
    d_head = kv.groups[0].req_to_blocks["d"][0]
    assert a.block_hashes[0] == d.block_hashes[0] and kv.pool.lookup(d.block_hashes[0]) is d_head
    kv.allocate_slots(a, a.num_tokens - 2)  # a's head duplicates d's (unpublished); a's block 1 is published
    a.num_computed_tokens = a.num_tokens
    a_head, a_second = kv.groups[0].req_to_blocks["a"][:2]
    assert a_head.block_hash is None and kv.pool.lookup(a.block_hashes[1]) is a_second
    kv.free(d)
    filler = req("f", [3] * (5 * BS))
    admit(kv, filler)  # takes every free block, evicting all of d's
    assert kv.pool.lookup(d.block_hashes[0]) is None
    kv.free(filler)
    kv.free(a)
    assert kv.pool.lookup(a.block_hashes[1]) is a_second  # the orphaned second block is still cached
    q = req("q", X + Z + [1])
    (hits,), n_hit = kv.get_computed_blocks(q)
    assert hits == [] and n_hit == 0
    kv.check_invariants()
