"""A step's integer inputs on their way to the device: one host-to-device copy per step.

With async scheduling some input ids are placeholders for tokens the previous step sampled; they are
filled on the device from that step's sampled tensor, never read back to the host first.
"""

from __future__ import annotations

import numpy as np
import torch


class StepInputs:
    """One step's integer inputs, built on the host with numpy and sent in ONE host-to-device copy
    through a persistent pinned staging buffer (pinning fresh memory each step costs milliseconds)."""

    FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "logits_indices",
              "placeholder_index", "placeholder_rows", "block_tables")
    # Models with several KV cache groups add group g's "block_tables_g" and "slot_mapping_g" (g >= 1).

    # Every field starts on a 64-byte boundary: Triton specializes kernels on pointer alignment, so
    # fields at arbitrary offsets would make mixed steps compile new kernel variants mid-run.
    ALIGN = 16

    def __init__(self, arrays: dict[str, np.ndarray], device: torch.device, staging: StagingBuffer | None = None):
        names = [*self.FIELDS, *(name for name in arrays if name not in self.FIELDS)]
        flat = [arrays[f].reshape(-1) for f in names]
        offsets, total = [], 0
        for a in flat:
            offsets.append(total)
            total += -(-a.size // self.ALIGN) * self.ALIGN
        host = staging.take(total) if staging is not None else torch.empty(total, dtype=torch.int32)
        host_np = host.numpy()
        for a, offset in zip(flat, offsets):
            host_np[offset:offset + a.size] = a
        dev = host.to(device, non_blocking=True)
        if staging is not None:
            staging.copy_issued()
        for field_name, a, offset in zip(names, flat, offsets):
            setattr(self, field_name, dev[offset:offset + a.size])
            setattr(self, field_name + "_cpu", host[offset:offset + a.size])
            if field_name.startswith("block_tables"):
                setattr(self, field_name, getattr(self, field_name).view(arrays[field_name].shape))


class StagingBuffer:
    """Pinned host memory reused every step. Before it is overwritten we wait for the previous copy out
    of it (long done: it was queued before the previous step's kernels, which have been launched since)."""

    def __init__(self, size: int):
        self.buffer = torch.empty(size, dtype=torch.int32).pin_memory()
        self.copied = torch.cuda.Event()

    def copy_issued(self) -> None:
        self.copied.record()

    def take(self, n: int) -> torch.Tensor:
        self.copied.synchronize()
        if n > self.buffer.numel():
            self.buffer = torch.empty(2 * n, dtype=torch.int32).pin_memory()
        return self.buffer[:n]


def fill_placeholders(input_ids: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, last_sampled) -> None:
    """input_ids[index] = last_sampled[rows], on the device (ids sampled by the step before)."""
    input_ids[index.long()] = last_sampled[rows.long()].to(input_ids.dtype)


NO_PLACEHOLDERS = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
