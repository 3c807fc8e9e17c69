"""Engine settings and prompts shared by the end-to-end tests of the worker-side proposers (draft model, EAGLE-3)."""

from __future__ import annotations

from kvserve import SamplingParams
from tests.conftest import random_prompts

# 5 blocks of 16 tokens cannot hold the three prompts (36-44 tokens) at once: preemptions; a 32-token
# budget chunks every prompt (and caps the draft's catch-up); prompts 0 and 1 share two full blocks.
TIGHT = dict(max_model_len=80, block_size=16, num_gpu_blocks_override=5, max_num_batched_tokens=32,
             max_num_seqs=3, enable_chunked_prefill=True, enable_prefix_caching=True)
# Room for every request, and a budget that catches a whole prompt up in one step: every slot is filled.
ROOMY = dict(max_model_len=160, block_size=16, num_gpu_blocks_override=40, max_num_seqs=4,
             enable_prefix_caching=True)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Three prompts of 36-44 tokens; the second starts with the first's 32 tokens (two full blocks)."""
    base = random_prompts(3, 36, 44, seed=seed)
    return [base[0], base[0][:32] + base[1][:9], base[2]]
