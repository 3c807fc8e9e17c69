"""The one function that applies a step's token bitmask to the logits (worker side), before sampling.

Bit j of word w in a row allows token 32 * w + j. On CUDA xgrammar's kernel applies it; elsewhere a few
torch ops do (the same function, tested against xgrammar's CPU implementation).
"""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool (True = allowed)."""
    shifts = _SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                        mask_rows: list[int] | None = None) -> None:
    """Sets to -inf, in place, each disallowed token of logits[rows[i]] per bitmask[mask_rows[i]] (without
    mask_rows: bitmask[i], one bitmask row per entry of rows). On CUDA the compact bitmask crosses to the
    device once (pinned by its maker where it can be) and is gathered and scattered there, so the host's part
    stays small at any batch size."""
    if not rows:
        return
    if logits.is_cuda:
        import xgrammar

        device = logits.device
        on_device = bitmask.to(device, non_blocking=True)
        if mask_rows is not None and mask_rows != list(range(bitmask.shape[0])):
            on_device = on_device.index_select(0, _index(mask_rows, device))
        if rows == list(range(logits.shape[0])):
            xgrammar.apply_token_bitmask_inplace(logits, on_device)
            return
        # xgrammar's `indices` pick the same row of logits and of the bitmask: lay the rows out as the logits.
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=device)
        full.index_copy_(0, _index(rows, device), on_device)
        xgrammar.apply_token_bitmask_inplace(logits, full, indices=rows)
        return
    if mask_rows is not None:
        bitmask = bitmask[mask_rows]
    index = torch.tensor(rows, dtype=torch.long)
    vocab = logits.shape[-1]
    allowed = allowed_tokens(bitmask, vocab)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _index(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).pin_memory().to(device, non_blocking=True)
