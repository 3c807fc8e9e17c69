"""Sample and prompt logprobs against HF transformers' log-softmax on the same weights (fp32, 1e-4)."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import random_prompts

TOL = 1e-4


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(llama):
    # A small token budget splits the longer prompts into chunks: prompt logprobs must span them.
    return LLM(llama[0], max_model_len=256, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32, max_num_seqs=8)


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row t is the distribution of the token after ids[:t + 1]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check_entry(entry: dict, actual: int, ref_row: torch.Tensor, k: int, tokenizer) -> None:
    assert math.isclose(entry[actual].logprob, ref_row[actual].item(), abs_tol=TOL)
    # A random tiny model's distribution is nearly flat: near-ties within the tolerance may go either way.
    x = ref_row[actual]
    assert 1 + int((ref_row > x + TOL).sum()) <= entry[actual].rank <= int((ref_row >= x - TOL).sum())
    assert entry[actual].decoded_token == tokenizer.decode([actual])
    top = ref_row.topk(k).values.tolist()
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)  # the alternatives
    assert [r for r, _, _ in ranked] == list(range(1, k + 1))
    for r, t, v in ranked:
        assert math.isclose(v, ref_row[t].item(), abs_tol=TOL) and math.isclose(v, top[r - 1], abs_tol=TOL)
    assert len(entry) in (k, k + 1)


def test_sample_logprobs_match_hf(llm, llama):
    _, hf = llama
    tok = llm.get_tokenizer()
    prompts = random_prompts(2, 10, 45, seed=21)
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, seed=4, max_tokens=5, ignore_eos=True, logprobs=0)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out, p in zip(prompts, outs, params):
        comp = out.outputs[0]
        ref = _hf_logprobs(hf, prompt + comp.token_ids)
        assert len(comp.logprobs) == len(comp.token_ids) == 5
        total = 0.0
        for j, (t, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            row = ref[len(prompt) - 1 + j]  # raw distribution, whatever the temperature
            if p.logprobs:
                _check_entry(entry, t, row, p.logprobs, tok)
            else:
                assert list(entry) == [t] and math.isclose(entry[t].logprob, row[t].item(), abs_tol=TOL)
            total += row[t].item()
        assert math.isclose(comp.cumulative_logprob, total, abs_tol=1e-3)


def test_no_logprobs_unless_asked(llm):
    comp = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert comp.logprobs is None and comp.cumulative_logprob is None


def test_prompt_logprobs_match_hf_across_chunks_and_prefix_cache(llm, llama):
    _, hf = llama
    tok = llm.get_tokenizer()
    prompt = random_prompts(1, 70, 70, seed=22)[0]  # three prefill chunks of <= 32 tokens
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)  # now the prompt's blocks are cached
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    # The cached prefix was not reused: every prompt position needs its logits.
    assert out.num_cached_tokens == 0
    ref = _hf_logprobs(hf, prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for t in range(1, len(prompt)):
        _check_entry(out.prompt_logprobs[t], prompt[t], ref[t - 1], 2, tok)
    plain_out = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain_out.outputs[0].token_ids
