"""CUDA graphs for whole forward passes, all sharing one memory pool.

Two kinds, each captured at a few padded sizes:
- decode graphs: B requests of one token each (B = 1, 2, 4, 8, 16, ... max_num_seqs), split-KV decode;
- mixed graphs: up to T tokens (T = 16 ... 512) of any requests, prefill chunks included. A short prompt's
  prefill launches ~360 kernels; eagerly their host cost is longer than the GPU work (time to first token).
A step runs in the smallest graph it fits; larger steps run eagerly (their GPU work hides the launches).

Graphs read their inputs from one static int32 device buffer with fixed regions, filled by ONE
host-to-device copy per step from a pinned twin. Padding tokens write nowhere (slot -1); in a mixed graph
they form one extra request that attends to block 0 (finite values, results dropped), and unused request
rows are empty (no tokens, no keys). A model with several KV cache groups has a slot mapping per group and
its block tables interleaved by row ([rows, groups, blocks]: group g's table is a view with a row stride),
so the used prefix of the buffer stays one copy.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvserve.ops.attention_metadata import AttentionMetadata
from kvserve.worker.step_inputs import fill_placeholders

logger = logging.getLogger(__name__)



def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (vLLM's spacing); padding waste stays under 8 rows."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def _aligned(n: int) -> int:
    # 64-byte regions: Triton specializes on pointer alignment (an odd offset would compile anew mid-run).
    return -(-n // 16) * 16


class CudaGraphRunner:
    def __init__(self, model, kv_caches, block_size: int, max_blocks_per_seq: int, max_model_len: int,
                 sizes: list[int], device: torch.device, num_kv_splits, mixed_sizes: list[int] = (),
                 max_num_seqs: int | None = None, num_kv_cache_groups: int = 1):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = sorted(sizes)
        self.mixed_sizes = sorted(mixed_sizes)
        self.max_num_seqs = max_num_seqs or self.sizes[-1]
        self.num_kv_splits = num_kv_splits  # padded batch size -> splits, shared with eager decode steps
        self.max_size = self.sizes[-1]
        self.max_blocks = mb = max_blocks_per_seq
        # Room for the largest graph of either kind: T tokens, R request rows.
        t = max([self.max_size, *self.mixed_sizes])
        r = max([self.max_size, *(self._mixed_rows(s) for s in self.mixed_sizes)])
        self.max_tokens, self.max_rows = t, r
        self.num_groups = g = num_kv_cache_groups
        layout = [("input_ids", t), ("positions", t), ("slot_mapping", t), ("placeholder_index", t),
                  ("placeholder_rows", t), ("query_start_loc", r + 1), ("seq_lens", r), ("logits_indices", r),
                  *((f"slot_mapping_{i}", t) for i in range(1, g)), ("block_tables", r * g * mb)]
        self.offsets, total = {}, 0
        for name, size in layout:
            self.offsets[name] = total
            total += _aligned(size)
        self.static = torch.zeros(total, dtype=torch.int32, device=device)
        for name, size in layout:
            setattr(self, name, self.static[self.offsets[name]:self.offsets[name] + size])
        self.group_tables = self.block_tables.view(r, g, mb)
        self.block_tables = self.group_tables[:, 0]
        self.slot_mappings = [self.slot_mapping, *(getattr(self, f"slot_mapping_{i}") for i in range(1, g))]
        for slots in self.slot_mappings:
            slots.fill_(-1)
        self.host = torch.zeros_like(self.static, device="cpu").pin_memory()
        self.host_np = self.host.numpy()
        self.copied = torch.cuda.Event()
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.pool = None

    def _mixed_rows(self, num_tokens: int) -> int:
        # Every request has >= 1 token, so T tokens hold at most T requests; one more row for the padding.
        return min(num_tokens, self.max_num_seqs) + 1

    def _meta(self, kind: str, size: int) -> AttentionMetadata:
        # max_seq_len is fixed at capture (kernels size grids from it and stop at each seq_len).
        rows = size if kind == "decode" else self._mixed_rows(size)

        def group_meta(g: int) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=self.slot_mappings[g][:size],
                query_start_loc=self.query_start_loc[: rows + 1],
                seq_lens=self.seq_lens[:rows],
                block_tables=self.group_tables[:rows, g],
                max_query_len=1 if kind == "decode" else size,
                max_seq_len=self.max_model_len,
                num_actual_tokens=size,
                block_size=self.block_size,
                num_kv_splits=self.num_kv_splits(size) if kind == "decode" else None,
            )

        meta = group_meta(0)
        meta.other_groups = tuple(group_meta(g) for g in range(1, self.num_groups))
        return meta

    def _forward(self, kind: str, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(kind, size))

    def _set_capture_inputs(self, kind: str, size: int) -> None:
        # Valid inputs for warm-up and capture: every token its own request (decode) or one request of
        # `size` tokens (mixed), writing nowhere and reading block 0.
        rows = size if kind == "decode" else self._mixed_rows(size)
        for slots in self.slot_mappings:
            slots.fill_(-1)
        self.group_tables.zero_()
        if kind == "decode":
            self.query_start_loc[: rows + 1].copy_(torch.arange(rows + 1, dtype=torch.int32))
            self.seq_lens[:rows].fill_(1)
        else:
            qsl = torch.full((rows + 1,), size, dtype=torch.int32)
            qsl[0] = 0
            self.query_start_loc[: rows + 1].copy_(qsl)
            self.seq_lens[:rows].zero_()
            self.seq_lens[0] = size

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        mem0 = torch.cuda.mem_get_info()[0]
        # Largest first: later, smaller graphs fit in the pool the first one reserved.
        order = [("mixed", s) for s in reversed(self.mixed_sizes)] + [("decode", s) for s in reversed(self.sizes)]
        order.sort(key=lambda k: -k[1])
        for key in order:
            self._set_capture_inputs(*key)
            for _ in range(2):  # warm-up: triton JIT and cuBLAS handles outside the capture
                self._forward(*key)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[key] = self._forward(*key)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        used = mem0 - torch.cuda.mem_get_info()[0]
        logger.info(
            "Captured %d CUDA graphs (decode batch sizes %d..%d, mixed steps up to %d tokens) in %.1f s, using %.2f GiB",
            len(self.graphs), self.sizes[0], self.max_size, max(self.mixed_sizes, default=0),
            time.perf_counter() - t0, used / (1 << 30),
        )

    def padded_size(self, num_reqs: int) -> int | None:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def mixed_padded_size(self, num_tokens: int) -> int | None:
        for s in self.mixed_sizes:
            if s >= num_tokens:
                return s
        return None

    def fits_rows(self, num_logits_rows: int) -> bool:
        """Whether a mixed step's sampled positions fit the staged logits-index region."""
        return num_logits_rows <= self.max_rows

    def _stage(self, key, tokens: dict, rows: dict, tables: list[np.ndarray], num_rows: int, placeholders,
               last_sampled):
        """Write the step's arrays (already padded; `tables`: each group's block tables) into the pinned
        twin, copy the used prefix of each region in one go, fill placeholders and replay."""
        self.copied.synchronize()  # the previous step's copy out of the staging buffer is done
        h, off = self.host_np, self.offsets
        for name, a in {**tokens, **rows}.items():
            h[off[name]:off[name] + a.size] = a
        index, sampled_rows = placeholders
        k = index.size
        h[off["placeholder_index"]:off["placeholder_index"] + k] = index
        h[off["placeholder_rows"]:off["placeholder_rows"] + k] = sampled_rows
        mb, g = self.max_blocks, self.num_groups
        bt = h[off["block_tables"]:off["block_tables"] + num_rows * g * mb].reshape(num_rows, g, mb)
        for i, table in enumerate(tables):
            bt[:table.shape[0], i, :table.shape[1]] = table
            bt[table.shape[0]:num_rows, i, 0] = 0
        used = off["block_tables"] + num_rows * g * mb
        self.static[:used].copy_(self.host[:used], non_blocking=True)
        self.copied.record()
        if k:
            fill_placeholders(self.input_ids, self.placeholder_index[:k], self.placeholder_rows[:k], last_sampled)
        self.graphs[key].replay()
        return self.outputs[key]

    @staticmethod
    def _slot_mappings(slot_mapping, other_groups, pad: int) -> dict:
        """Each group's slot mapping, padded with writes to nowhere."""
        mappings = [slot_mapping, *(slots for _, slots in other_groups)]
        names = ["slot_mapping", *(f"slot_mapping_{g}" for g in range(1, len(mappings)))]
        return {name: np.concatenate([slots, np.full(pad, -1, np.int64)]) for name, slots in zip(names, mappings)}

    def run(self, num_reqs: int, input_ids, positions, slot_mapping, seq_lens, block_tables,
            placeholders, last_sampled, other_groups=()) -> torch.Tensor:
        """A decode step's numpy inputs -> replay; returns hidden [num_reqs, H].
        `placeholders` (flat index, row in last_sampled): input ids still on the device, filled after the copy.
        `other_groups`: (block tables, slot mapping) of KV cache groups 1, 2, ..."""
        bs = self.padded_size(num_reqs)
        pad = bs - num_reqs
        # Padding rows write nowhere and attend to one slot of block 0; their results are dropped.
        tokens = {
            "input_ids": np.concatenate([input_ids, np.zeros(pad, np.int64)]),
            "positions": np.concatenate([positions, np.zeros(pad, np.int64)]),
            **self._slot_mappings(slot_mapping, other_groups, pad),
        }
        rows = {"query_start_loc": np.arange(bs + 1), "seq_lens": np.concatenate([seq_lens, np.ones(pad, np.int64)])}
        tables = [block_tables, *(t for t, _ in other_groups)]
        out = self._stage(("decode", bs), tokens, rows, tables, bs, placeholders, last_sampled)
        return out[:num_reqs]

    def run_mixed(self, input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                  logits_indices, placeholders, last_sampled, other_groups=()) -> torch.Tensor:
        """Any step of at most the largest mixed size in tokens -> replay; returns the hidden states of
        the `logits_indices` tokens (the rows that sample)."""
        num_tokens, num_reqs = input_ids.size, seq_lens.size
        size = self.mixed_padded_size(num_tokens)
        rows_pad = self._mixed_rows(size)
        pad = size - num_tokens
        tokens = {
            "input_ids": np.concatenate([input_ids, np.zeros(pad, np.int64)]),
            "positions": np.concatenate([positions, np.arange(pad)]),
            **self._slot_mappings(slot_mapping, other_groups, pad),
        }
        # The padding tokens are one more request (causal over `pad` keys of block 0); later rows are empty.
        qsl = np.full(rows_pad + 1, size, dtype=np.int64)
        qsl[:num_reqs + 1] = query_start_loc
        lens = np.zeros(rows_pad, dtype=np.int64)
        lens[:num_reqs] = seq_lens
        lens[num_reqs] = pad
        n = logits_indices.size
        rows = {"query_start_loc": qsl, "seq_lens": lens, "logits_indices": logits_indices}
        tables = [block_tables, *(t for t, _ in other_groups)]
        out = self._stage(("mixed", size), tokens, rows, tables, rows_pad, placeholders, last_sampled)
        return out[self.logits_indices[:n].long()]
