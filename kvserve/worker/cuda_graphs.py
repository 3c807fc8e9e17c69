"""CUDA graphs for decode-only steps: one graph per padded batch size, all sharing one memory pool.

A decode step launches hundreds of small kernels; replaying a captured graph removes the per-launch
host cost, which dominates at small batch. Graphs read their inputs from static buffers that the
runner fills before each replay.
"""

from __future__ import annotations

import logging
import time

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


class CudaGraphRunner:
    def __init__(self, model, kv_caches, block_size: int, max_blocks_per_seq: int, max_model_len: int,
                 sizes: list[int], device: torch.device, num_kv_splits):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = sorted(sizes)
        self.num_kv_splits = num_kv_splits  # padded batch size -> splits, shared with eager decode steps
        self.max_size = self.sizes[-1]
        n = self.max_size
        self.max_blocks = max_blocks_per_seq
        # All graph inputs live in ONE int32 device buffer with fixed regions, so a step's inputs arrive
        # in a single host-to-device copy: [ids | positions | slots | seq_lens | placeholder index | rows
        # | block tables (n x MB)]. The placeholder regions are read outside the graph (async scheduling).
        self.static = torch.zeros(6 * n + n * max_blocks_per_seq, dtype=torch.int32, device=device)
        self.input_ids = self.static[0:n]
        self.positions = self.static[n:2 * n]
        self.slot_mapping = self.static[2 * n:3 * n]
        self.seq_lens = self.static[3 * n:4 * n]
        self.placeholder_index = self.static[4 * n:5 * n]
        self.placeholder_rows = self.static[5 * n:6 * n]
        self.block_tables = self.static[6 * n:].view(n, max_blocks_per_seq)
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.host = torch.zeros_like(self.static, device="cpu").pin_memory()
        self.host_np = self.host.numpy()
        self.copied = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        # max_seq_len is fixed at capture (kernels size grids from it and stop at each seq_len).
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_actual_tokens=bs,
            block_size=self.block_size,
            num_kv_splits=self.num_kv_splits(bs),
        )

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        mem0 = torch.cuda.mem_get_info()[0]
        # Largest first: later, smaller graphs fit in the pool the first one reserved.
        for bs in reversed(self.sizes):
            for _ in range(2):  # warm-up: triton JIT and cuBLAS handles outside the capture
                self._forward(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        used = mem0 - torch.cuda.mem_get_info()[0]
        logger.info(
            "Captured %d CUDA graphs (batch sizes %d..%d) in %.1f s, using %.2f GiB",
            len(self.sizes), self.sizes[0], self.max_size, time.perf_counter() - t0, used / (1 << 30),
        )

    def padded_size(self, num_reqs: int) -> int | None:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def run(self, num_reqs: int, input_ids, positions, slot_mapping, seq_lens, block_tables,
            placeholders, last_sampled) -> torch.Tensor:
        """Numpy inputs of a decode step -> pinned staging -> one copy -> replay; returns hidden [num_reqs, H].
        `placeholders` (flat index, row in last_sampled): input ids still on the device, filled after the copy."""
        bs = self.padded_size(num_reqs)
        n, mb = self.max_size, self.max_blocks
        self.copied.synchronize()  # the previous step's copy out of the staging buffer is done
        h = self.host_np
        h[0:num_reqs] = input_ids
        h[num_reqs:bs] = 0
        h[n:n + num_reqs] = positions
        h[n + num_reqs:n + bs] = 0
        # Padding rows write nowhere and attend to one slot of block 0; their results are dropped.
        h[2 * n:2 * n + num_reqs] = slot_mapping
        h[2 * n + num_reqs:2 * n + bs] = -1
        h[3 * n:3 * n + num_reqs] = seq_lens
        h[3 * n + num_reqs:3 * n + bs] = 1
        index, rows = placeholders
        k = index.size
        h[4 * n:4 * n + k] = index
        h[5 * n:5 * n + k] = rows
        tables = h[6 * n:6 * n + bs * mb].reshape(bs, mb)
        tables[:num_reqs, :block_tables.shape[1]] = block_tables
        tables[num_reqs:bs, 0] = 0
        used = 6 * n + bs * mb
        self.static[:used].copy_(self.host[:used], non_blocking=True)
        self.copied.record()
        if k:
            fill_placeholders(self.input_ids, self.placeholder_index[:k], self.placeholder_rows[:k], last_sampled)
        self.graphs[bs].replay()
        return self.outputs[bs][:num_reqs]
