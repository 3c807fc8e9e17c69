"""A compact picture of the KV cache and the requests holding it, for the live /dashboard page.

Taken in the engine core between steps, at most every SNAPSHOT_INTERVAL_S (and once more when the engine
goes idle, so the last picture is exact), and sent with that step's EngineBatch. Its size is bounded
whatever the cache size: block states are aggregated into at most MAX_CELLS cells, and at most MAX_REQUESTS
request rows are kept (the largest first). One pass over the block list per snapshot is the only cost that
grows with the cache: about 60k blocks for a million tokens of 16-token blocks, every half second.
"""

from __future__ import annotations

import time

SNAPSHOT_INTERVAL_S = 0.5
MAX_CELLS = 2048
MAX_REQUESTS = 64

# One character per cell, the state that holds most of its blocks (ties: the busier state).
FREE, CACHED, USED, SHARED = "f", "c", "u", "s"


def pool_summary(pool, max_cells: int = MAX_CELLS) -> dict:
    """Counts per block state and the cell grid. free: never used or evicted; cached: free but still a
    prefix-cache hit (evictable); used: held by one request; shared: held by several (ref count >= 2)."""
    n = pool.num_blocks
    per_cell = -(-n // max_cells)
    cells = []
    shared_refs: dict[int, int] = {}  # cell -> highest ref count in it
    counts = {FREE: 0, CACHED: 0, USED: 0, SHARED: 0}
    ref_histogram: dict[int, int] = {}
    blocks = pool.blocks
    for start in range(0, n, per_cell):
        cell = {FREE: 0, CACHED: 0, USED: 0, SHARED: 0}
        top_ref = 0
        for block in blocks[start:start + per_cell]:
            ref = block.ref_cnt
            if ref == 0:
                cell[CACHED if block.block_hash is not None else FREE] += 1
            elif ref == 1:
                cell[USED] += 1
            else:
                cell[SHARED] += 1
                top_ref = max(top_ref, ref)
                ref_histogram[ref] = ref_histogram.get(ref, 0) + 1
        for state, k in cell.items():
            counts[state] += k
        # Busier states win ties, so a cell with any shared block in a tie shows as shared.
        cells.append(max((SHARED, USED, CACHED, FREE), key=lambda s: cell[s]))
        if top_ref:
            shared_refs[len(cells) - 1] = top_ref
    return {
        "num_blocks": n,
        "free": counts[FREE],
        "cached": counts[CACHED],
        "used": counts[USED],
        "shared": counts[SHARED],
        "usage": pool.usage(),
        "blocks_per_cell": per_cell,
        "cells": "".join(cells),
        "shared_refs": shared_refs,
        "ref_histogram": ref_histogram,
    }


def request_rows(scheduler, kv_manager, max_rows: int = MAX_REQUESTS) -> list[dict]:
    """Running and waiting requests, the ones holding the most blocks first."""
    rows = []
    for queue_name, queue in (("running", scheduler.running), ("waiting", scheduler.waiting)):
        for req in queue:
            rows.append({
                "id": req.request_id,
                "queue": queue_name,
                "status": req.status.name.lower(),
                "prompt_tokens": req.num_prompt_tokens,
                "generated_tokens": req.num_output_tokens,
                "computed_tokens": req.num_computed_tokens,
                "blocks": kv_manager.num_blocks_held(req),
                "prefix_hit_tokens": max(req.num_cached_tokens, 0),
                "preemptions": req.num_preemptions,
            })
    rows.sort(key=lambda r: (-r["blocks"], r["id"]))
    return rows[:max_rows]


def take_snapshot(engine) -> dict:
    scheduler, kv = engine.scheduler, engine.kv_cache_manager
    return {
        "time": time.time(),
        "block_size": kv.block_size,
        "prefix_caching": kv.enable_caching,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "pool": pool_summary(kv.pool),
        "requests": request_rows(scheduler, kv),
    }


class SnapshotSampler:
    """Decides when the engine core takes a snapshot: every SNAPSHOT_INTERVAL_S while busy, and once when
    it becomes idle (so what the page shows at rest is exact)."""

    def __init__(self, interval: float = SNAPSHOT_INTERVAL_S, clock=time.monotonic):
        self.interval = interval
        self.clock = clock
        self._last = float("-inf")
        self._idle_sent = False

    def maybe_take(self, engine) -> dict | None:
        now = self.clock()
        idle = not engine.has_unfinished_requests()
        if idle and self._idle_sent:
            return None
        if not idle and now - self._last < self.interval:
            return None
        self._last = now
        self._idle_sent = idle
        try:
            return take_snapshot(engine)
        except Exception:  # noqa: BLE001 - a picture for a web page must never stop the step loop
            return None
