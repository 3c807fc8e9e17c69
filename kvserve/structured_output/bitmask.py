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


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets to -inf, in place, each disallowed token of logits[rows[i]] per bitmask[i]."""
    if not rows:
        return
    if logits.is_cuda:
        import xgrammar

        # One row per logits row (all ones where unconstrained), so row i of each tensor is the same request.
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, pin_memory=True)
        full[rows] = bitmask
        xgrammar.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True))
        return
    index = torch.tensor(rows, dtype=torch.long)
    vocab = logits.shape[-1]
    allowed = allowed_tokens(bitmask, vocab)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
