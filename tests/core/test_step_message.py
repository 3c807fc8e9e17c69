"""The step message (core/sched_output.py) is the whole contract between the scheduler and the workers:
every executor hands the same object to Worker.execute_model (uni as it is, mp and ray pickled). Here a
scheduler's messages, pickled as mp sends them, are applied to a worker-side InputBatch, which must then
know every request's tokens, block table and this step's chunk exactly as the scheduler does."""

from __future__ import annotations

import pickle
import random

import torch

from kvserve.core.kv_cache_manager import FREED, KVCacheManager
from kvserve.core.request import Request
from kvserve.core.sched_output import PLACEHOLDER_TOKEN_ID
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.worker.input_batch import InputBatch


class _Params:
    max_tokens = 12
    ignore_eos = True
    seed = None
    min_tokens = 0


def _run(async_scheduling: bool, drafts: bool, group_windows=(None,), num_blocks: int = 14) -> dict[str, int]:
    rng = random.Random(3)
    bs = 4
    kv = KVCacheManager(num_blocks=num_blocks, block_size=bs, group_windows=group_windows)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=10, max_model_len=40), kv)
    for i in range(5):
        prompt = [rng.randrange(50) for _ in range(rng.randint(3, 14))]
        sched.add_request(Request(f"r{i}", prompt, _Params()))
    batch = InputBatch(max_num_seqs=3, max_blocks_per_request=10, block_size=bs, device=torch.device("cpu"),
                       num_kv_cache_groups=len(group_windows))
    in_flight = None
    steps = 0
    seen = {"placeholders": 0, "trims": 0, "drafts": 0, "resumed": 0}
    while sched.has_unfinished_requests() or in_flight is not None:
        if drafts and in_flight is None:
            sched.update_draft_token_ids({r.request_id: [rng.randrange(50) for _ in range(2)] for r in sched.running})
        out = sched.schedule()
        msg = pickle.loads(pickle.dumps(out.message))  # what a worker process receives
        states = batch.apply(msg)
        seen["trims"] += len(msg.trimmed_block_tables)
        seen["drafts"] += len(msg.scheduled_spec_decode_tokens)
        seen["resumed"] += sum(1 for new in msg.scheduled_new_reqs if new.output_token_ids)
        seen["placeholders"] += sum(PLACEHOLDER_TOKEN_ID in s.token_ids for s in states)
        assert [s.request_id for s in states] == [s.request_id for s in out.scheduled]
        for state, s in zip(states, out.scheduled):
            # The worker rebuilt the scheduler's record of this step from the diff alone.
            assert (state.start_pos, state.token_ids, state.needs_sample, state.output_len) == (
                s.start_pos, s.token_ids, s.needs_sample, s.output_len)
            assert list(state.spec_token_ids) == list(s.spec_token_ids)
            for g, rows in enumerate(batch.group_tables):  # every KV cache group's table
                row = rows.rows[s.request_id]
                table = kv.block_ids(s.request_id, g)
                # Entries that left a window are never read again: the worker may keep their old ids.
                freed = sum(1 for blk in kv.groups[g].req_to_blocks[s.request_id] if blk is FREED)
                assert rows.lengths[row] == len(table)
                assert rows.table[row, freed:rows.lengths[row]].tolist() == table[freed:]
            r = s.request
            known = r.prompt_token_ids + r.output_token_ids
            assert state.prompt_token_ids + state.output_token_ids == known
        # The message never aliases the scheduler's own lists.
        for new in out.message.scheduled_new_reqs:
            assert new.output_token_ids is not sched.requests[new.req_id].output_token_ids
        # One token, or with drafts 1 to 1 + k (some drafts "rejected": the scheduler rolls them back).
        sampled = {s.request_id: [rng.randrange(50) for _ in range(rng.randint(1, 1 + len(s.spec_token_ids)))]
                   for s in out.scheduled if s.needs_sample}
        if async_scheduling and not drafts:
            if in_flight is not None:
                sched.update(*in_flight)
            in_flight = (out, sampled) if out.scheduled else None
            if not out.scheduled and not sched.has_unfinished_requests():
                break
        else:
            sched.update(out, sampled)
        steps += 1
        assert steps < 500
    sched.schedule()
    assert kv.pool.num_free_blocks == kv.num_blocks
    return seen


def test_workers_rebuild_every_step_from_the_message():
    assert _run(async_scheduling=False, drafts=False)["resumed"] > 0  # preempted and resumed requests too


def test_with_placeholders_in_flight():
    assert _run(async_scheduling=True, drafts=False)["placeholders"] > 0


def test_with_drafts_and_rollback():
    seen = _run(async_scheduling=False, drafts=True)
    assert seen["drafts"] > 0 and seen["trims"] > 0


def test_interleaved_groups_each_get_their_tables():
    """A Gemma-shaped cache (windowed, full and windowed groups): every group's table reaches the worker,
    the windowed groups' freed entries included, with preemption and rollbacks."""
    seen = _run(async_scheduling=False, drafts=True, group_windows=(5, None, 3), num_blocks=18)
    assert seen["resumed"] > 0 and seen["trims"] > 0
