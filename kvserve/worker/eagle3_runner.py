"""The EAGLE-3 head of `"method": "eagle3"` on the worker: it reads three of the target's hidden states
after each target forward, and fills the draft slots of the next step.

The head at position t reads the token at t + 1 and the target's states at t, and predicts the token at
t + 2. So after the target's forward (and its sampling or verification) the head runs over the same
positions, fed each position's next token: the step's own input shifted by one, and at the rows that
sampled, the tokens sampled there (a rejected row gets a stand-in; its K/V is rewritten when the target
computes that position again). Its outputs at the sampled rows are kept: in the next step, a request's
first draft is the head's token at the row of its last accepted position, and the chained drafts after it
feed the head its own pre-norm state (one-token passes over the step's draft slots).

The head's one-layer cache has the target's block layout and shares its block ids. It is written in
steps that have drafts or prefill chunks and in the step after each; while speculation is off (two steps
in a row without either) decode steps skip the head, and what it missed only costs acceptance when
drafting resumes (verification is exact). A prefix hit reuses the head's K/V of the shared blocks, whose
last position was written with the next token of the request that wrote it: that too costs only
acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.core.sched_output import StepMessage
from kvserve.model.eagle3 import Eagle3Config, Eagle3Head
from kvserve.model.loader import DTYPES, _fill_dummy, iter_safetensors_weights
from kvserve.model.model_config import load_hf_config_dict
from kvserve.worker.draft_model_runner import draft_layout
from kvserve.worker.input_batch import RequestState, StepLayout


@dataclass
class _HeadOutputs:
    """The head's outputs at the sampled rows of the last step it ran."""

    draft_ids: torch.Tensor  # [L] the target id each row proposes (for the position two after it)
    prenorm: torch.Tensor  # [L, H] the state a chained draft after that row reads
    rows: dict[str, tuple[int, int, int]]  # request id -> (first row, its position, number of rows)


def _head_weights(path):
    """The head's tensors: safetensors, or the pytorch_model.bin that some public heads ship instead (read
    as plain tensors: weights_only runs no pickled code)."""
    if not any(path.glob("*.safetensors")) and (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True).items()
    return iter_safetensors_weights(path)


class Eagle3Runner:
    def __init__(self, config: EngineConfig, target_model, backend, kv_cache_dtype: torch.dtype, build_inputs):
        self.device = torch.device(config.device)
        self.block_size = config.args.block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.build_inputs = build_inputs
        path = config.draft_model_path
        self.head_config = Eagle3Config.from_hf_dict(load_hf_config_dict(path), config.model_config)
        self.model_config = self.head_config.layer
        previous = torch.get_default_dtype()
        torch.set_default_dtype(DTYPES[config.dtype])
        try:
            with torch.device(config.device):
                self.head = Eagle3Head(self.head_config, backend, config.max_model_len)
        finally:
            torch.set_default_dtype(previous)
        if config.args.load_format == "dummy":
            _fill_dummy(self.head, config.args.seed)
            self.head.d2t.zero_()
            loaded = {n for n, _ in self.head.named_parameters()}
        else:
            loaded = self.head.load_weights(_head_weights(path))
        if "embed_tokens.weight" not in loaded:  # heads saved without one read the target's
            self.head.share_embedding(target_model.embed_tokens)
        missing = {n for n, _ in self.head.named_parameters() if not n.startswith("embed_tokens")} - loaded
        if missing:
            raise ValueError(f"The EAGLE-3 head at {path} lacks {', '.join(sorted(missing)[:5])}")
        self.head.eval()
        target_model.aux_layer_ids = self.head_config.aux_layer_ids  # the target now returns their states
        self.weights_bytes = sum(p.numel() * p.element_size() for n, p in self.head.named_parameters()
                                 if "embed_tokens" not in n or "embed_tokens.weight" in loaded)
        self.kv_caches: list[torch.Tensor] = []
        self.last: _HeadOutputs | None = None
        # The step after one with drafts or prefill chunks runs the head too: the first decode step after
        # a prefill has no drafts yet, and what it skipped the next drafts would miss.
        self._after_busy = False

    # ---- KV cache ------------------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        attn = self.head.layers[0].self_attn
        shape = (2, num_blocks, self.block_size, attn.num_kv_heads, self.model_config.kv_cache_head_dim)
        return [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.allocate_kv_cache(num_blocks)

    def apply(self, msg: StepMessage) -> None:
        """Nothing outlives a step but the last head outputs, which name their requests."""

    # ---- before the target's forward: the drafts -----------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: list[RequestState], tables: np.ndarray) -> None:
        last = self.last
        if last is None:
            return
        ready, rows, first_pos = [], [], {}
        for i, s in enumerate(batch):
            if not s.spec_token_ids or s.request_id not in last.rows:
                continue
            first_row, row_pos, num_rows = last.rows[s.request_id]
            f = s.start_pos + len(s.token_ids) - len(s.spec_token_ids)  # the first draft slot's position
            j = f - 2 - row_pos  # the row of the head at f - 2, which predicted position f
            if 0 <= j < num_rows:
                ready.append(i)
                rows.append(first_row + j)
                first_pos[i] = f
        if not ready:
            return
        index = torch.tensor(rows, dtype=torch.long, device=last.draft_ids.device)
        drafts = [last.draft_ids[index]]
        prenorm = last.prenorm[index]
        k = {i: len(batch[i].spec_token_ids) for i in ready}
        for d in range(1, max(k.values())):
            live = [m for m, i in enumerate(ready) if k[i] > d]
            # The head at f - 2 + d reads draft d (at f - 1 + d) and its own state at f - 3 + d.
            pieces = [(ready[m], first_pos[ready[m]] - 2 + d, None) for m in live]
            layout = draft_layout(tables, pieces, list(range(len(live))), self.block_size)
            inputs, meta = self.build_inputs(layout)
            normed, state = self.head(drafts[-1][live], inputs.positions, prenorm[live], self.kv_caches[0], meta)
            nxt = torch.zeros_like(drafts[-1])
            nxt[live] = self._draft_ids(normed)
            new_prenorm = prenorm.clone()
            new_prenorm[live] = state
            drafts.append(nxt)
            prenorm = new_prenorm
        values = torch.stack(drafts, dim=1).tolist()  # the one host sync: the verify metadata reads drafts
        for m, i in enumerate(ready):
            batch[i].set_drafts(values[m][:k[i]])

    # ---- after it: the head over the step's positions ------------------------------------------------
    @torch.inference_mode()
    def observe(self, batch: list[RequestState], layout: StepLayout, inputs, meta, aux: list[torch.Tensor],
                row_tokens: torch.Tensor | None) -> None:
        """`aux`: the target's three states at every token of the step; `row_tokens`: the token sampled
        at each logits row (-1 past a rejection), or None when nothing sampled."""
        busy = layout.has_drafts or any(len(s.token_ids) - len(s.spec_token_ids) > 1 for s in batch)
        run, self._after_busy = busy or self._after_busy, busy
        if not run:  # a second step without drafts or prefills: speculation is off, the head rests
            self.last = None
            return
        ids = inputs.input_ids.long()
        next_ids = torch.empty_like(ids)
        next_ids[:-1] = ids[1:]
        # A chunk that does not sample: the token after it is known on the host.
        ends, tokens = [], []
        for i, s in enumerate(batch):
            if not s.needs_sample:
                end = s.start_pos + len(s.token_ids)
                ends.append(int(layout.query_start_loc[i + 1]) - 1)
                tokens.append((s.known_tokens(end, end + 1) or [0])[0])
        if ends:
            next_ids[torch.tensor(ends, device=ids.device)] = torch.tensor(tokens, device=ids.device)
        rows: dict[str, tuple[int, int, int]] = {}
        logits_index = inputs.logits_indices.long()
        if row_tokens is not None and logits_index.numel():
            next_ids[logits_index] = row_tokens.to(next_ids.dtype).clamp(min=0)
            r = 0
            for s in layout.sampling_requests:
                n = 1 + len(s.spec_token_ids)
                first_pos = s.start_pos + len(s.token_ids) - n
                rows[s.request_id] = (r, first_pos, n)
                r += n
        hidden = self.head.combine(aux)
        normed, prenorm = self.head(next_ids, inputs.positions, hidden, self.kv_caches[0], meta)
        if not rows:
            self.last = None
            return
        self.last = _HeadOutputs(self._draft_ids(normed[logits_index]), prenorm[logits_index], rows)

    def _draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(self.head.compute_draft_logits(normed).argmax(dim=-1))
