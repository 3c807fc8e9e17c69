"""benchmarks/ab_kernels.w2_steps: W2's prefill steps as the GPU comparison rebuilds them (no GPU needed)."""

from __future__ import annotations

from benchmarks.ab_kernels import w2_steps
from kvserve.bench.datasets import w2_requests


def test_w2_steps_follow_chunked_prefill():
    prompts = [r.prompt_len for r in w2_requests()]
    steps = w2_steps(list(range(45)))
    for step, batch in steps.items():
        assert sum(n for _, n in batch) <= 16384
        decodes = [b for b in batch if b[1] == 1]
        chunks = [b for b in batch if b[1] > 1]
        assert batch[:len(decodes)] == decodes  # the running requests' decodes come first
        if step < 43:
            assert sum(n for _, n in batch) == 16384  # prompts wait: the budget is full
        for ctx, n in chunks:
            assert ctx + n <= max(prompts)
    assert [len(steps[s]) for s in (0, 2)] == [2, 5]
    assert steps[0] == [(0, prompts[0]), (0, 16384 - prompts[0])]
    computed = sum(n for batch in steps.values() for ctx, n in batch if n > 1)
    assert computed <= sum(prompts)
