"""Turns a SchedulerOutput into one flat forward pass and returns each request's sampled token."""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.core.scheduler import SchedulerOutput
from kvserve.model.loader import DTYPES, load_model
from kvserve.ops.attention_backend import get_attention_backend
from kvserve.ops.attention_metadata import AttentionMetadata
from kvserve.worker.sampler import SamplingMetadata, sample

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.args.block_size
        self.model_config = config.model_config
        self.backend = get_attention_backend(config.attention_backend)
        self.model = load_model(
            config.model_config,
            config.model_path,
            config.args.load_format,
            config.dtype,
            config.device,
            self.backend,
            max_positions=config.max_model_len,
            seed=config.args.seed,
        )
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        # Per-request state that outlives a step.
        self.block_tables: dict[str, list[int]] = {}
        self.generators: dict[str, torch.Generator] = {}

    # ---- KV cache --------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.model_config.kv_bytes_per_token(elem) * self.block_size

    def initialize_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model_config
        shape = (2, num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        # Zeros, not empty: padded reads of never-written slots must be finite (0 * NaN = NaN).
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.num_blocks = num_blocks

    # ---- one step --------------------------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self.block_tables.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.block_tables.pop(rid, None)  # the generator stays: a resumed request continues its stream
        for s in out.scheduled:
            if s.is_new:
                self.block_tables[s.request_id] = list(s.new_block_ids)
            else:
                self.block_tables[s.request_id].extend(s.new_block_ids)
            seed = getattr(s.sampling_params, "seed", None)
            if seed is not None and s.request_id not in self.generators:
                self.generators[s.request_id] = torch.Generator(device=self.device).manual_seed(seed)

    def prepare_inputs(self, out: SchedulerOutput):
        sched = out.scheduled
        num_reqs = len(sched)
        q_lens = np.fromiter((len(s.token_ids) for s in sched), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.start_pos for s in sched), dtype=np.int64, count=num_reqs)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        input_ids = np.fromiter((t for s in sched for t in s.token_ids), dtype=np.int64, count=num_tokens)
        req_idx = np.repeat(np.arange(num_reqs), q_lens)
        positions = np.arange(num_tokens) - qsl[req_idx] + starts[req_idx]
        seq_lens = starts + q_lens

        max_blocks = max(len(self.block_tables[s.request_id]) for s in sched)
        tables = np.zeros((num_reqs, max_blocks), dtype=np.int64)
        for i, s in enumerate(sched):
            row = self.block_tables[s.request_id]
            tables[i, : len(row)] = row
        bs = self.block_size
        slot_mapping = tables[req_idx, positions // bs] * bs + positions % bs
        logits_rows = [i for i, s in enumerate(sched) if s.needs_sample]
        logits_indices = qsl[1:][logits_rows] - 1

        dev = self.device
        qsl_t = torch.from_numpy(qsl.astype(np.int32))
        seq_lens_t = torch.from_numpy(seq_lens.astype(np.int32))
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=qsl_t.to(dev),
            seq_lens=seq_lens_t.to(dev),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            num_actual_tokens=num_tokens,
            block_size=bs,
            query_start_loc_cpu=qsl_t,
            seq_lens_cpu=seq_lens_t,
        )
        return (
            torch.from_numpy(input_ids).to(dev),
            torch.from_numpy(positions).to(dev),
            meta,
            torch.from_numpy(logits_indices).to(dev),
            logits_rows,
        )

    def _sampling_metadata(self, out: SchedulerOutput, rows: list[int]) -> SamplingMetadata:
        params = [out.scheduled[i].sampling_params for i in rows]
        temps = [p.temperature for p in params]
        all_greedy = all(t < 1e-5 for t in temps)
        dev = self.device
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        return SamplingMetadata(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_k=torch.tensor(top_k, device=dev) if any(top_k) else None,
            top_p=torch.tensor(top_p, dtype=torch.float32, device=dev) if any(p < 1 for p in top_p) else None,
            min_p=torch.tensor(min_p, dtype=torch.float32, device=dev) if any(min_p) else None,
            generators={
                j: self.generators[out.scheduled[i].request_id]
                for j, i in enumerate(rows)
                if out.scheduled[i].request_id in self.generators
            },
            all_greedy=all_greedy,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        self._update_states(out)
        if out.is_empty:
            return {}
        input_ids, positions, meta, logits_indices, rows = self.prepare_inputs(out)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[logits_indices]).float()
        tokens = sample(logits, self._sampling_metadata(out, rows)).tolist()
        return {out.scheduled[i].request_id: tok for i, tok in zip(rows, tokens)}
