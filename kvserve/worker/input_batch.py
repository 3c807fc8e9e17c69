"""The worker's persistent batch: the one owner of each live request's worker-side state.

Step messages (core/sched_output.py) are applied here, whichever executor delivered them: a request's
prompt, sampling parameters and output history, its row of block ids, its seeded generator, and the
last ids this rank sampled (kept on the device: with async scheduling the next step's placeholders are
filled from them). From that state `layout()` builds one StepLayout, the host arrays that both the eager
forward and the CUDA-graph replays read.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np
import torch

from kvserve.core.sched_output import ONE_PLACEHOLDER, PLACEHOLDER_TOKEN_ID, StepMessage


class BlockTables:
    """Every running request's block ids in one persistent numpy array (a row per request), so a step
    gathers its table with one fancy index instead of rebuilding it from Python lists."""

    def __init__(self, max_rows: int, max_blocks: int):
        self.table = np.zeros((max_rows, max_blocks), dtype=np.int64)
        self.lengths = np.zeros(max_rows, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))

    def add(self, rid: str, block_ids: list[int]) -> None:
        if not self.free_rows:  # more live requests than max_num_seqs (possible only transiently)
            grow = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
            self.free_rows = list(range(2 * grow - 1, grow - 1, -1))
        row = self.free_rows.pop()
        self.rows[rid] = row
        self.lengths[row] = 0
        self.append(rid, block_ids)

    def append(self, rid: str, block_ids: list[int]) -> None:
        row = self.rows[rid]
        n = int(self.lengths[row])
        self.table[row, n:n + len(block_ids)] = block_ids
        self.lengths[row] = n + len(block_ids)

    def trim(self, rid: str, num_blocks: int) -> None:
        """Keeps the first `num_blocks` of a row (the scheduler freed the rest: rejected drafts' slots)."""
        row = self.rows.get(rid)
        if row is not None:
            self.lengths[row] = min(int(self.lengths[row]), num_blocks)

    def release(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is not None:
            self.free_rows.append(row)

    def gather(self, rids: list[str]) -> np.ndarray:
        rows = np.fromiter(map(self.rows.__getitem__, rids), dtype=np.int64, count=len(rids))
        return self.table[rows, : int(self.lengths[rows].max())]


class RequestState:
    """One request as this worker knows it; the per-step fields describe its chunk in the current step."""

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "output_token_ids", "adapter_id",
                 "start_pos", "token_ids", "spec_token_ids", "needs_sample", "output_len")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params, output_token_ids: list[int],
                 adapter_id=None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.output_token_ids = output_token_ids
        self.adapter_id = adapter_id
        self.start_pos = 0
        self.token_ids: list[int] = []
        self.spec_token_ids: list[int] = []
        self.needs_sample = False
        self.output_len = 0

    def schedule(self, num_tokens: int, spec_token_ids: list[int]) -> None:
        """This step computes tokens [start_pos, start_pos + num_tokens): known ids, then the token the step
        in flight samples (a placeholder, filled on the device), then the drafts."""
        start = self.start_pos
        prompt, outputs = self.prompt_token_ids, self.output_token_ids
        p = len(prompt)
        known = p + len(outputs)
        end = start + num_tokens - len(spec_token_ids)
        if start >= known and not spec_token_ids:  # a decode behind the step in flight: a placeholder
            tokens = ONE_PLACEHOLDER if end - known == 1 else [PLACEHOLDER_TOKEN_ID] * (end - known)
        else:
            stop = min(end, known)
            if stop <= p:
                tokens = prompt[start:stop]
            elif start >= p:
                tokens = outputs[start - p:stop - p]
            else:
                tokens = prompt[start:] + outputs[:stop - p]
            if end > known:
                tokens += [PLACEHOLDER_TOKEN_ID] * (end - known)
        if spec_token_ids:
            tokens += spec_token_ids
        self.token_ids = tokens
        self.spec_token_ids = spec_token_ids
        # A chunk that reaches the known tokens samples (the scheduler never stops a chunk right before
        # a token in flight: that token is all a request with one in flight has left to compute).
        self.needs_sample = end >= known
        self.output_len = len(outputs) + (end > known)

    def known_tokens(self, start: int, end: int) -> list[int]:
        """Positions [start, end) of the prompt and the outputs this worker holds (no copy of the rest)."""
        prompt, p = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= p:
            return prompt[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return prompt[start:] + self.output_token_ids[:end - p]

    def set_drafts(self, draft_token_ids: list[int]) -> None:
        """A draft model's tokens in this step's draft slots (the scheduler sent placeholders)."""
        n = len(self.spec_token_ids)
        if len(draft_token_ids) != n:
            raise ValueError(f"{len(draft_token_ids)} draft tokens for {n} draft slots")
        self.token_ids = self.token_ids[:len(self.token_ids) - n] + list(draft_token_ids)
        self.spec_token_ids = list(draft_token_ids)


@dataclass
class StepLayout:
    """One step's host arrays, in batch order: what the eager forward and the graph replays both read."""

    token_ids: np.ndarray  # [T] flat input ids (placeholders still -1)
    q_lens: np.ndarray  # [B] tokens per request
    starts: np.ndarray  # [B] position of each request's first token
    block_tables: np.ndarray  # [B, max blocks] (KV cache group 0's)
    query_start_loc: np.ndarray  # [B + 1]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    logits_indices: np.ndarray  # [L] flat token index of every position that is sampled
    sample_states: list  # [L] the request each logits row samples for
    sampling_requests: list  # the requests that sample, in order (each owns 1 + len(drafts) rows)
    placeholders: tuple[np.ndarray, np.ndarray]  # (flat index in token_ids, row in last_sampled)
    has_drafts: bool
    # Models with several KV cache groups: (block_tables, slot_mapping) of groups 1, 2, ...
    other_groups: tuple[tuple[np.ndarray, np.ndarray], ...] = ()

    @property
    def seq_lens(self) -> np.ndarray:
        return self.starts + self.q_lens


_token_ids, _start_pos, _request_id = attrgetter("token_ids"), attrgetter("start_pos"), attrgetter("request_id")
NO_PLACEHOLDERS = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


class InputBatch:
    def __init__(self, max_num_seqs: int, max_blocks_per_request: int, block_size: int, device: torch.device,
                 num_kv_cache_groups: int = 1):
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, RequestState] = {}
        # One table per KV cache group (core/kv_cache_groups.py); every group's row has the same length.
        self.group_tables = [BlockTables(max_num_seqs, max_blocks_per_request) for _ in range(num_kv_cache_groups)]
        self.generators: dict[str, torch.Generator] = {}
        # The last step's sampled ids, on the device, and each request's row in them.
        self.last_sampled: torch.Tensor | None = None
        self.last_sampled_rows: dict[str, int] = {}
        # Live requests that asked for prompt logprobs, and whether the last applied step verifies drafts.
        self.prompt_logprobs_ids: set[str] = set()
        self.has_drafts = False

    @property
    def block_tables(self) -> BlockTables:
        """KV cache group 0's tables (the only ones of a model whose layers all attend alike)."""
        return self.group_tables[0]

    def apply(self, msg: StepMessage) -> list[RequestState]:
        """Takes in one step message; returns the step's requests in batch order."""
        reqs, groups = self.requests, self.group_tables
        for rid in msg.finished_req_ids:  # first: a finished id may be reused in this very step
            reqs.pop(rid, None)
            for tables in groups:
                tables.release(rid)
            self.generators.pop(rid, None)
            self.prompt_logprobs_ids.discard(rid)
        for rid in msg.preempted_req_ids:
            for tables in groups:
                tables.release(rid)  # the generator stays: a resumed request continues its stream
        for rid, num_blocks in msg.trimmed_block_tables.items():
            for tables in groups:
                tables.trim(rid, num_blocks)
        for new in msg.scheduled_new_reqs:
            rid = new.req_id
            state = reqs[rid] = RequestState(rid, new.prompt_token_ids, new.sampling_params, new.output_token_ids,
                                             new.adapter_id)
            state.start_pos = new.num_computed_tokens
            for tables, block_ids in zip(groups, new.block_ids, strict=True):
                tables.release(rid)
                tables.add(rid, block_ids)
            seed = getattr(new.sampling_params, "seed", None)
            if seed is not None and rid not in self.generators:
                self.generators[rid] = torch.Generator(device=self.device).manual_seed(seed)
            if getattr(new.sampling_params, "prompt_logprobs", None) is not None:
                self.prompt_logprobs_ids.add(rid)
            else:
                self.prompt_logprobs_ids.discard(rid)
        cached = msg.scheduled_cached_reqs
        for rid, new_tokens, new_blocks, start in zip(cached.req_ids, cached.new_token_ids, cached.new_block_ids,
                                                      cached.num_computed_tokens):
            state = reqs[rid]
            state.start_pos = start
            if new_tokens:
                state.output_token_ids.extend(new_tokens)
            if new_blocks[0]:  # every group grows at the same positions
                for tables, block_ids in zip(groups, new_blocks):
                    tables.append(rid, block_ids)
        spec = msg.scheduled_spec_decode_tokens
        self.has_drafts = bool(spec)
        batch = []
        append = batch.append
        for rid, num in msg.num_scheduled_tokens.items():
            state = reqs[rid]
            state.schedule(num, spec.get(rid, ()) if spec else ())
            append(state)
        return batch

    def wants_prompt_logprobs(self, batch: list[RequestState]) -> bool:
        """Whether a request of this step asked for prompt logprobs (most steps: none is live at all)."""
        ids = self.prompt_logprobs_ids
        return bool(ids) and any(s.request_id in ids for s in batch)

    def layout(self, batch: list[RequestState]) -> StepLayout:
        num_reqs = len(batch)
        # map / attrgetter / chain walk the batch in C: this runs once per request per step.
        tokens = list(map(_token_ids, batch))
        q_lens = np.fromiter(map(len, tokens), dtype=np.int64, count=num_reqs)
        starts = np.fromiter(map(_start_pos, batch), dtype=np.int64, count=num_reqs)
        token_ids = np.fromiter(chain.from_iterable(tokens), dtype=np.int64, count=int(q_lens.sum()))
        rids = list(map(_request_id, batch))
        tables = self.group_tables[0].gather(rids)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        req_idx = np.repeat(np.arange(num_reqs), q_lens)
        positions = np.arange(token_ids.size) - qsl[req_idx] + starts[req_idx]
        bs = self.block_size
        block_index, offset = positions // bs, positions % bs
        slot_mapping = tables[req_idx, block_index] * bs + offset
        other_groups = []
        for group in self.group_tables[1:]:
            group_tables = group.gather(rids)
            other_groups.append((group_tables, group_tables[req_idx, block_index] * bs + offset))
        sampling = [i for i, s in enumerate(batch) if s.needs_sample]
        sampling_requests = [batch[i] for i in sampling]
        has_drafts = self.has_drafts and any(s.spec_token_ids for s in sampling_requests)
        if not has_drafts:  # one logits row per sampling request: its chunk's last token
            logits_indices = qsl[1:][sampling] - 1
            sample_states = sampling_requests
        else:  # a request with k drafts samples at its last 1 + k tokens
            index, sample_states = [], []
            for i in sampling:
                s = batch[i]
                n = 1 + len(s.spec_token_ids)
                end = int(qsl[i + 1])
                index.extend(range(end - n, end))
                sample_states.extend([s] * n)
            logits_indices = np.asarray(index, dtype=np.int64)
        return StepLayout(token_ids, q_lens, starts, tables, qsl, positions, slot_mapping, logits_indices,
                          sample_states, sampling_requests,
                          self._placeholders(batch, token_ids, qsl), has_drafts, tuple(other_groups))

    def _placeholders(self, batch, token_ids: np.ndarray, qsl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flat index in the step's tokens, row in last_sampled) of each token sampled by the step in flight."""
        index = np.flatnonzero(token_ids == PLACEHOLDER_TOKEN_ID)
        if not index.size:
            return NO_PLACEHOLDERS
        reqs = np.searchsorted(qsl[1:], index, side="right")
        rows = np.fromiter((self.last_sampled_rows[batch[i].request_id] for i in reqs), dtype=np.int64,
                           count=len(reqs))
        return index, rows

    def record_sampled(self, sampled: torch.Tensor, layout: StepLayout) -> None:
        """Keeps this step's sampled ids on the device for the next step's placeholders. A request that
        verified drafts has no row: the scheduler never schedules one past a step whose count is unknown."""
        self.last_sampled = sampled
        if not layout.has_drafts:
            self.last_sampled_rows = {s.request_id: j for j, s in enumerate(layout.sample_states)}
        else:
            rows, j = {}, 0
            for s in layout.sampling_requests:
                if not s.spec_token_ids:
                    rows[s.request_id] = j
                j += 1 + len(s.spec_token_ids)
            self.last_sampled_rows = rows
