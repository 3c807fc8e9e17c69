"""The sum of each token's K weighted pair rows at the end of a MoE layer (kvserve/ops/moe_sum.py): equal, bit
for bit, to adding the rows in fp32 in k order and rounding once, on the CPU under Triton's interpreter
(tests/kernels/test_triton_interpreter.py) and compiled on a GPU (the gpu tier)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.ops.moe_sum import sum_pairs  # noqa: E402
from tests.triton_interpreter import INTERPRETED, KERNEL_DEVICE, KERNEL_TIER  # noqa: E402

pytestmark = KERNEL_TIER


def _reference(rows: torch.Tensor, top_k: int) -> torch.Tensor:
    pairs = rows.float().view(-1, top_k, rows.shape[1])
    acc = torch.zeros_like(pairs[:, 0])
    for k in range(top_k):
        acc += pairs[:, k]
    return acc.to(rows.dtype)


# Several column blocks with a partial last one (2,880: gpt-oss), a width under one block, top-k 1 to 8.
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 8, 2048), (37, 2, 2880), (5, 1, 100), (3, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_pairs_equals_the_fp32_sum_in_k_order(tokens, top_k, hidden, dtype):
    g = torch.Generator().manual_seed(tokens)
    rows = torch.randn(tokens * top_k, hidden, generator=g).to(dtype)
    got = sum_pairs(rows.to(KERNEL_DEVICE), top_k).cpu()
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    if INTERPRETED and dtype == torch.bfloat16:  # the interpreter truncates to bf16: within one unit of it
        torch.testing.assert_close(got, _reference(rows, top_k), atol=0, rtol=2**-7)
    else:
        assert torch.equal(got, _reference(rows, top_k))
    assert torch.allclose(got.float(), rows.float().view(tokens, top_k, hidden).sum(1), rtol=1e-2, atol=1e-2)


def test_sum_pairs_reads_rows_through_their_stride_and_takes_no_tokens():
    wide = torch.randn(6, 40).to(KERNEL_DEVICE)
    rows = wide[:, :24]  # row stride 40
    assert torch.equal(sum_pairs(rows, 2).cpu(), _reference(rows.cpu(), 2))
    assert sum_pairs(torch.empty(0, 24, device=KERNEL_DEVICE), 8).shape == (0, 24)


def test_sum_pairs_refuses_rows_that_are_not_whole_tokens():
    with pytest.raises(ValueError, match="tokens \\* 4"):
        sum_pairs(torch.zeros(6, 8, device=KERNEL_DEVICE), 4)
