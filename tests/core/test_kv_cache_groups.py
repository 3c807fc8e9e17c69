"""KV cache groups (interleaved local/global attention, Gemma-shaped): how layers are grouped, and a
KVCacheManager with a full group and windowed groups on one block pool: the windowed groups free the
blocks that left their window while the full group keeps every block, prefix hits need every group's
blocks, swap preemption moves only live blocks."""

from __future__ import annotations

from kvserve.core.group_block_tables import FREED, first_block_in_window
from kvserve.core.kv_cache_groups import (
    KVCacheGroup,
    kv_cache_groups,
    layer_placements,
    longest_request_tokens,
    num_kv_slots,
    request_blocks,
)
from kvserve.core.kv_cache_manager import KVCacheManager, cdiv
from tests.core.test_kv_cache_manager import req

BS = 4
W = 6
GEMMA = (W, None, W)  # windowed, full, windowed: Gemma 2's alternation in groups of one layer


def test_groups_of_gemma2_gemma3_and_uniform_models():
    assert kv_cache_groups([None] * 4) == [KVCacheGroup(None, (0, 1, 2, 3))]
    assert kv_cache_groups([8] * 3) == [KVCacheGroup(8, (0, 1, 2))]
    # Gemma 2: alternating; groups as large as the smaller kind's layer count.
    assert kv_cache_groups([8, None] * 2) == [KVCacheGroup(8, (0, 2)), KVCacheGroup(None, (1, 3))]
    # Gemma 3 (5 windowed : 1 full), 12 layers: 2 full layers, so windowed groups of 2.
    gemma3 = ([8] * 5 + [None]) * 2
    groups = kv_cache_groups(gemma3)
    assert [g.window for g in groups] == [8, 8, 8, None, 8, 8]  # in order of their first layer (full: 5, 11)
    assert sorted(layer for g in groups for layer in g.layers) == list(range(12))
    assert all(len(g.layers) == 2 for g in groups) and num_kv_slots(gemma3, range(12)) == 2
    # Uneven counts: the last windowed group is shorter (its tensor slots partly unused).
    assert [len(g.layers) for g in kv_cache_groups([8] * 5 + [None] * 2)] == [2, 2, 1, 2]


def test_layer_placements_per_pipeline_stage():
    windows = [8, None] * 3  # groups (0, 2, 4) and (1, 3, 5)
    whole = layer_placements(windows, range(6))
    assert [(whole[i].group, whole[i].slot) for i in range(6)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    # Stage 1 of 2 holds layers 3-5: each group's layers there take slots from 0.
    stage = layer_placements(windows, range(3, 6))
    assert [(stage[i].group, stage[i].slot) for i in range(3, 6)] == [(1, 0), (0, 0), (1, 1)]
    assert num_kv_slots(windows, range(3, 6)) == 2


def test_request_blocks_and_longest_request():
    # 100 tokens, chunk 8: the full group holds 25 blocks, each windowed one cdiv(6 - 1 + 8, 4) + 1 = 5.
    assert request_blocks(GEMMA, 100, 8, BS) == 25 + 5 + 5
    assert request_blocks((None,), 100, 8, BS) == 25
    assert longest_request_tokens((None,), 30, 8, BS) == 30 * BS
    assert longest_request_tokens(GEMMA, 30, 8, BS) == 20 * BS  # 30 - 2 x 5 for the full group
    assert request_blocks(GEMMA, 20 * BS, 8, BS) <= 30 < request_blocks(GEMMA, 21 * BS, 8, BS)


def decode(kv: KVCacheManager, r) -> None:
    assert kv.allocate_slots(r, 1) is not None
    r.num_computed_tokens += 1
    r.append_output_token(7)


def live(kv: KVCacheManager, rid: str, g: int) -> list[int]:
    return [b.block_id for b in kv.groups[g].req_to_blocks[rid] if b is not FREED]


def test_windowed_groups_free_blocks_behind_the_window_and_the_full_group_keeps_all():
    kv = KVCacheManager(40, BS, enable_caching=False, group_windows=GEMMA)
    r = req("a", range(10, 20))
    ids = kv.allocate_slots(r, r.num_tokens)
    assert [len(i) for i in ids] == [3, 3, 3]  # 10 tokens: 3 blocks in each group
    r.num_computed_tokens = r.num_tokens
    for _ in range(40):  # 50 tokens: 13 blocks per group without windows, 39 in all
        decode(kv, r)
        first = first_block_in_window(r.num_computed_tokens - 1, BS, W)
        for g, window in enumerate(GEMMA):
            table = kv.groups[g].req_to_blocks["a"]
            assert len(table) == cdiv(r.num_computed_tokens, BS)  # positions line up across groups
            if window is None:
                assert FREED not in table
            else:
                assert all(b is FREED for b in table[:first]) and len(live(kv, "a", g)) <= W // BS + 2
        kv.check_invariants()
    assert kv.num_blocks_held(r) == 13 + len(live(kv, "a", 0)) + len(live(kv, "a", 2)) < 13 + 2 * 4
    kv.free(r)
    assert kv.pool.num_free_blocks == 40
    kv.check_invariants()


def admit(kv: KVCacheManager, r):
    hits, n_hit = kv.get_computed_blocks(r)
    ids = kv.allocate_slots(r, r.num_tokens - n_hit, hits)
    assert ids is not None
    r.num_computed_tokens = r.num_tokens
    return hits, n_hit


def test_prefix_hit_needs_every_group():
    kv = KVCacheManager(64, BS, group_windows=GEMMA)
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks
    a = req("a", prompt)
    admit(kv, a)
    kv.free(a)
    b = req("b", prompt + [1, 2])
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 7 * BS
    first = first_block_in_window(n_hit, BS, W)
    assert [len(h) for h in hits] == [7, 7, 7]
    assert FREED not in hits[1] and all(h is FREED for h in hits[0][:first] + hits[2][:first])
    # Evicting an old block of a windowed group costs nothing; one inside its window shortens the hit;
    # one of the full group cuts it there.
    evict = lambda g, i: kv.pool._evict(kv.pool.lookup(kv.groups[g].key(a.block_hashes[i])))  # noqa: E731
    evict(0, 0)
    assert kv.get_computed_blocks(b)[1] == 7 * BS
    evict(2, 5)  # block 5 is inside the window of position 28 (blocks 5, 6) and of 24 (4, 5)
    assert kv.get_computed_blocks(b)[1] == 5 * BS
    evict(1, 3)
    assert kv.get_computed_blocks(b)[1] == 3 * BS
    hits, n_hit = admit(kv, b)
    assert n_hit == 3 * BS
    kv.check_invariants()
    kv.free(b)
    assert kv.pool.num_free_blocks == 64
    kv.check_invariants()


def test_one_groups_allocation_never_evicts_another_groups_hit():
    """All hits are taken before any group allocates: allocating new blocks for one group pops the free
    queue, which may hold another group's (free, cached) hit."""
    kv = KVCacheManager(12, BS, group_windows=(None, None))
    a = req("a", range(2 * BS + 1))
    admit(kv, a)  # 3 blocks per group; 2 of each cached
    kv.free(a)  # every block free, the cached ones at the eviction end last
    b = req("b", list(range(2 * BS)) + [9] * (3 * BS))
    hits, n_hit = admit(kv, b)
    assert n_hit == 2 * BS
    tables = [kv.groups[g].req_to_blocks["b"] for g in range(2)]
    assert tables[0][:2] == hits[0] and tables[1][:2] == hits[1]
    kv.check_invariants()  # no block in two tables


def test_swap_out_and_in_moves_only_live_blocks():
    kv = KVCacheManager(40, BS, enable_caching=False, num_cpu_blocks=20, group_windows=GEMMA)
    r = req("a", range(30))
    admit(kv, r)
    decode(kv, r)  # the next step frees what the prompt's last query left behind its window
    held = kv.num_blocks_held(r)
    full = cdiv(31, BS)
    assert held == full + 2 * len(live(kv, "a", 0)) < 3 * full
    assert kv.can_swap_out(r)
    pairs = kv.swap_out(r)
    assert len(pairs) == held and kv.pool.num_free_blocks == 40 and kv.swap_space.num_free_blocks == 20 - held
    kv.check_invariants()
    back = kv.swap_in(r, 1)
    assert back is not None
    pairs_in, tables = back
    assert len(pairs_in) == held and kv.swap_space.num_free_blocks == 20
    for g, window in enumerate(GEMMA):
        assert len(tables[g]) == full + (r.num_tokens % BS == 0)
        freed = sum(1 for b in kv.groups[g].req_to_blocks["a"] if b is FREED)
        assert freed == (0 if window is None else first_block_in_window(31, BS, W))
    kv.check_invariants()
    kv.free(r)
    assert kv.pool.num_free_blocks == 40
    kv.check_invariants()
