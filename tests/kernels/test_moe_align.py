"""The sort of a MoE layer's (token, k) pairs into blocks of one expert each (kvserve/ops/moe_align.py): the
torch reference keeps every local pair exactly once, in a block of its own expert (property test); the Triton
versions, one program and three launches (the parallel path, forced on every case here), give the reference's
blocks, only the order inside an expert's run may differ; on the CPU under Triton's interpreter
(tests/kernels/test_triton_interpreter.py) and compiled on a GPU (the gpu tier)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from kvserve.ops import moe_align  # noqa: E402
from kvserve.ops.moe_align import align_block_size  # noqa: E402
from tests.triton_interpreter import INTERPRETED, KERNEL_DEVICE, KERNEL_TIER  # noqa: E402

pytestmark = KERNEL_TIER


@pytest.mark.skipif(not INTERPRETED, reason="pure torch: runs once, in the interpreter run")
@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 40), experts=st.integers(1, 12), data=st.data())
def test_align_block_size_puts_every_local_pair_in_one_block_of_its_expert(tokens, experts, data):
    top_k = data.draw(st.integers(1, experts))
    block_m = data.draw(st.sampled_from([1, 4, 16]))
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    elsewhere = data.draw(st.booleans())  # expert parallelism: some experts on other ranks (-1)
    if elsewhere:
        ids = torch.where(ids % 3 == 0, -1, ids)
    sorted_pairs, block_expert, num_rows = align_block_size(ids, experts, block_m)
    pairs = tokens * top_k
    rows = int(num_rows)
    assert rows % block_m == 0 and sorted_pairs.numel() == pairs + experts * (block_m - 1)
    used = sorted_pairs[:rows]
    real = used[used < pairs].tolist()
    flat = ids.reshape(-1)
    assert sorted(real) == [p for p in range(pairs) if flat[p] >= 0]  # each local pair once, others never
    assert (sorted_pairs[rows:] == pairs).all()
    for row in range(rows):
        pair = int(used[row])
        if pair < pairs:
            assert int(flat[pair]) == int(block_expert[row // block_m])  # a block holds one expert's pairs
    assert (block_expert[rows // block_m:] == -1).all()


def _ids(tokens, experts, top_k, elsewhere, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return torch.where(ids % 3 == 0, -1, ids) if elsewhere else ids


# Both Triton paths on every case (several blocks of pairs, a partial last one, experts on other ranks, 128
# experts, a 128-row tile).
ALIGN_CASES = [
    (1, 8, 2, 16, False), (37, 8, 2, 16, True), (5, 128, 8, 16, True), (128, 8, 8, 64, False),
    (1100, 4, 1, 32, False), (300, 16, 4, 64, False), (600, 8, 2, 16, True), (256, 128, 8, 32, False),
    (375, 128, 8, 128, True),
]


def test_the_cases_give_the_parallel_path_several_blocks_of_pairs_and_fit_one_program():
    pairs = [tokens * top_k for tokens, _, top_k, _, _ in ALIGN_CASES]
    assert sum(p > moe_align.CHUNK and p % moe_align.CHUNK for p in pairs) >= 2
    assert max(pairs) <= moe_align.ONE_PROGRAM_MAX_PAIRS


@pytest.mark.parametrize("path", ["one-program", "parallel"])
@pytest.mark.parametrize("tokens,experts,top_k,block_m,elsewhere", ALIGN_CASES)
def test_triton_align_equals_torch_align(tokens, experts, top_k, block_m, elsewhere, path, monkeypatch):
    monkeypatch.setattr(moe_align, "PARALLEL_ABOVE_PAIRS", moe_align.ONE_PROGRAM_MAX_PAIRS if path == "one-program"
                        else 0)
    ids = _ids(tokens, experts, top_k, elsewhere, seed=tokens)
    ref = align_block_size(ids, experts, block_m)
    got = [t.cpu() for t in moe_align.align_block_size_triton(ids.to(KERNEL_DEVICE), experts, block_m)]
    assert int(got[2]) == int(ref[2])
    assert got[1].tolist() == ref[1].tolist()
    assert expert_runs(got, block_m) == expert_runs(ref, block_m)


def expert_runs(aligned, block_m: int) -> dict[int, list[int]]:
    """Each expert's rows (its pairs and padding), sorted: the order inside a run is free (pairs of one expert
    may land in any of its blocks)."""
    sorted_pairs, block_expert, num_rows = (t.cpu() for t in aligned)
    runs: dict[int, list[int]] = {}
    for block in range(int(num_rows) // block_m):
        rows = sorted_pairs[block * block_m:(block + 1) * block_m].tolist()
        runs.setdefault(int(block_expert[block]), []).extend(rows)
    return {expert: sorted(rows) for expert, rows in runs.items()}
