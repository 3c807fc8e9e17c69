"""The router's one-launch expert choice (kvserve/ops/moe_routing.py) equals its torch reference
(kvserve.model.moe.select_experts_torch): the same experts, in the same order, and the same weights, for both
router kinds, with and without renormalisation, at expert counts that are and are not powers of two; on the CPU
under Triton's interpreter (tests/kernels/test_triton_interpreter.py) and compiled on a GPU (the gpu tier)."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.moe import select_experts_torch
from tests.triton_interpreter import KERNEL_DEVICE, KERNEL_TIER

pytestmark = KERNEL_TIER


def _logits(tokens, experts, dtype, seed=0):
    """Distinct in every row, also in bf16 (ties would leave torch.topk's order unspecified)."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)])
    return ((ranks - experts / 2) * 0.1).to(dtype).to(KERNEL_DEVICE)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (5, 60, 4), (37, 128, 8), (300, 32, 4), (3, 3, 3)])
@pytest.mark.parametrize("kind,renormalize", [("softmax_topk", True), ("softmax_topk", False),
                                              ("topk_softmax", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_kernel_equals_torch_reference(tokens, experts, top_k, kind, renormalize, dtype):
    from kvserve.ops.moe_routing import select_experts_triton

    logits = _logits(tokens, experts, dtype)
    want_w, want_ids = select_experts_torch(logits, top_k, renormalize, kind)
    got_w, got_ids = select_experts_triton(logits, top_k, renormalize, kind)
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
    assert torch.equal(got_ids, want_ids)
    # topk_softmax rounds its weights to the logits' dtype: the two exps may differ by that dtype's ulp.
    tol = 4e-3 if kind == "topk_softmax" and dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got_w, want_w, atol=tol, rtol=tol)


def test_routing_kernel_reads_strided_rows_and_breaks_ties_to_the_lower_expert():
    from kvserve.ops.moe_routing import select_experts_triton

    wide = _logits(6, 24, torch.float32)
    logits = wide[:, :16]  # a row stride of 24
    want_w, want_ids = select_experts_torch(logits, 4, True)
    got_w, got_ids = select_experts_triton(logits, 4, True)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
    tied = torch.zeros(2, 8, device=KERNEL_DEVICE)
    tied[:, 5] = 1.0
    weights, ids = select_experts_triton(tied, 3, True)
    assert ids.tolist() == [[5, 0, 1], [5, 0, 1]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, device=KERNEL_DEVICE))


def test_routing_kernel_refuses_a_top_k_beyond_the_experts():
    from kvserve.ops.moe_routing import select_experts_triton

    with pytest.raises(ValueError, match="top_k 9"):
        select_experts_triton(_logits(2, 8, torch.float32), 9, True)
