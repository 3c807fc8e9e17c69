"""The draft model of `"method": "draft_model"`: fills each drafting request's draft slots on the worker,
right before the target verifies them in the same step.

The engine reserves k draft slots per request (the scheduler allocates their K/V like any draft's); here
the draft model fills them: one catch-up pass writes the draft's K/V for every known token it has not seen
(the new tokens, or the whole context after admission, resumption or a pause in drafting) and proposes the
first draft from the last of them, then k - 1 chained one-token passes, each fed the previous greedy draft.
The draft's cache has the target's block layout and is indexed by the same block ids (a block holds both
models' K/V of its tokens), so the scheduler's allocation, rollback and freeing cover it too.

Which of a request's draft K/V is valid is this module's state: `computed[rid]` leading positions. After a
step that is the count of known tokens: the chained passes also wrote K/V of drafts that may be rejected,
and the next catch-up rewrites those positions. A request the worker sees anew (admitted, resumed after
recompute or swap, prefix hit) starts from 0: the draft K/V of blocks it shares or swapped back is not
trusted. Draft values never change the output (verification is exact), only how many are accepted.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.core.sched_output import StepMessage
from kvserve.model.loader import load_model
from kvserve.worker.input_batch import NO_PLACEHOLDERS, RequestState, StepLayout


def draft_layout(tables: np.ndarray, pieces: list, last_of: list[int], block_size: int) -> StepLayout:
    """The StepLayout of a draft forward over `pieces` (batch row, first position, token ids, or None for
    one token whose id is on the device), read at the last token of each piece listed in `last_of`."""
    q_lens = np.fromiter((1 if t is None else len(t) for _, _, t in pieces), dtype=np.int64, count=len(pieces))
    starts = np.fromiter((first for _, first, _ in pieces), dtype=np.int64, count=len(pieces))
    qsl = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    block_tables = tables[[i for i, _, _ in pieces]]
    req_idx = np.repeat(np.arange(len(pieces)), q_lens)
    positions = np.arange(int(qsl[-1])) - qsl[req_idx] + starts[req_idx]
    token_ids = np.fromiter((0 if t is None else x for _, _, t in pieces for x in (t or (0,))), dtype=np.int64,
                            count=int(qsl[-1]))
    return StepLayout(
        token_ids=token_ids, q_lens=q_lens, starts=starts, block_tables=block_tables, query_start_loc=qsl,
        positions=positions, slot_mapping=block_tables[req_idx, positions // block_size] * block_size
        + positions % block_size, logits_indices=qsl[1:][last_of] - 1, sample_states=[], sampling_requests=[],
        placeholders=NO_PLACEHOLDERS, has_drafts=False)


class DraftModelRunner:
    def __init__(self, config: EngineConfig, backend, kv_cache_dtype: torch.dtype, build_inputs):
        """`build_inputs`: the target runner's StepLayout -> (StepInputs, AttentionMetadata), so both
        models' steps reach the device the same way."""
        self.device = torch.device(config.device)
        self.block_size = config.args.block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.build_inputs = build_inputs
        self.model_config = config.draft_model_config
        # A dummy-weight target gets a dummy draft from the same seed: the same config is an oracle draft.
        load_format = "dummy" if config.args.load_format == "dummy" else "auto"
        self.model = load_model(self.model_config, config.draft_model_path, load_format, config.dtype,
                                config.device, backend, max_positions=config.max_model_len, seed=config.args.seed)
        if self.device.type == "cpu":
            from kvserve.ops.cpu_gemm import pack_cpu_linears

            pack_cpu_linears(self.model)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.kv_caches: list[torch.Tensor] = []
        # The most tokens one step's catch-up pass computes (the target's step budget): a request further
        # behind catches up over several steps, and its drafts stay unfilled meanwhile.
        self.max_catch_up_tokens = config.max_num_batched_tokens
        self.computed: dict[str, int] = {}

    # ---- KV cache ------------------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.block_size, self.model.num_local_kv_heads, self.model_config.kv_cache_head_dim)
        return [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                for _ in range(self.model.num_local_layers)]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.allocate_kv_cache(num_blocks)

    # ---- per-request state ---------------------------------------------------------------------------
    def apply(self, msg: StepMessage) -> None:
        """Forgets the draft K/V of requests that finished, were preempted or arrive anew."""
        for rid in (*msg.finished_req_ids, *msg.preempted_req_ids):
            self.computed.pop(rid, None)
        for new in msg.scheduled_new_reqs:
            self.computed[new.req_id] = 0

    # ---- proposing -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: list[RequestState], tables: np.ndarray) -> None:
        """Fills the draft slots of the step's drafting requests in place (RequestState.set_drafts).
        `tables[i]` is batch[i]'s block table."""
        rows = [i for i, s in enumerate(batch) if s.spec_token_ids]
        if not rows:
            return
        # Catch-up: each drafting request's known tokens from where its draft K/V ends (capped per step).
        room = self.max_catch_up_tokens
        catch_up, ready = [], []  # (row, first position, tokens); rows whose catch-up reaches the end
        for i in rows:
            s = batch[i]
            known = s.start_pos + len(s.token_ids) - len(s.spec_token_ids)  # no placeholders: drafting steps wait
            first = min(self.computed.get(s.request_id, 0), known - 1)
            n = min(known - first, room)
            if n <= 0:
                break
            room -= n
            catch_up.append((i, first, s.known_tokens(first, first + n)))
            self.computed[s.request_id] = first + n
            if first + n == known:
                ready.append(i)
        if not catch_up:
            return
        ready_rows = set(ready)
        draft = self._forward(tables, catch_up, last_of=[j for j, (i, _, _) in enumerate(catch_up) if i in ready_rows])
        # Chained passes: ready request j feeds its previous draft at the next position while it has slots.
        k = {i: len(batch[i].spec_token_ids) for i in ready}
        drafts = [draft]  # drafts[d][m]: the d-th draft of ready[m]
        end = {i: batch[i].start_pos + len(batch[i].token_ids) - k[i] for i in ready}  # first draft position
        for d in range(1, max(k.values(), default=0)):
            live = [m for m, i in enumerate(ready) if k[i] > d]
            feed = [(ready[m], end[ready[m]] + d - 1, None) for m in live]
            prev = drafts[-1]
            nxt = torch.zeros_like(prev)
            nxt[live] = self._forward(tables, feed, last_of=list(range(len(live))), input_ids=prev[live])
            drafts.append(nxt)
        values = torch.stack(drafts, dim=1).tolist()  # the one host sync: the verify metadata reads drafts
        for m, i in enumerate(ready):
            batch[i].set_drafts(values[m][:k[i]])

    def _forward(self, tables: np.ndarray, pieces: list, last_of: list[int],
                 input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One draft forward over `pieces` (batch row, first position, token ids or None for one token
        given on the device as `input_ids`); returns the greedy next token after the last token of each
        piece listed in `last_of`."""
        layout = draft_layout(tables, pieces, last_of, self.block_size)
        inputs, meta = self.build_inputs(layout)
        ids = inputs.input_ids
        if input_ids is not None:
            ids = input_ids.to(ids.dtype)
        hidden = self.model(ids, inputs.positions, self.kv_caches, meta, None)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return logits.argmax(dim=-1)
