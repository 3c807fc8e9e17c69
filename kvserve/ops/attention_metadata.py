"""What every attention backend needs about one step's flat batch. Built once per step by the model
runner and passed down through the model: no global state."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    # Per token (T = all scheduled tokens of all requests, concatenated by request).
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset where the token's K/V go
    # Per request (B requests).
    query_start_loc: torch.Tensor  # [B + 1] int32: request i's tokens are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks] int32: the request's blocks, padded with 0
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int  # T without CUDA-graph padding
    block_size: int
    # Split-KV decode: how many pieces each context is cut into (None: the backend decides). The runner
    # sets it for decode steps so a CUDA graph and an eager step of the same batch compute identically.
    num_kv_splits: int | None = None
    # Host copies for backends that loop on the CPU side (the torch reference).
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    # Models with several KV cache groups (core/kv_cache_groups.py): the metadata of groups 1, 2, ...,
    # equal to this one (group 0's) but for their block tables and slot mappings.
    other_groups: tuple["AttentionMetadata", ...] = ()
    # What a backend derives from this metadata once per step and reuses in every layer (the torch
    # backend's plans, per window).
    backend_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata a layer of KV cache group `group` attends with."""
        return self if group == 0 else self.other_groups[group - 1]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]
