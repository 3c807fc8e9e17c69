"""Logit-editing parameters end to end, greedy, against HF transformers on the same weights: HF's own
logits processors where it has the same one, else a step-by-step HF loop applying vLLM's formula."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import random_prompts

N = 6


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(llama[0], max_model_len=256, kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(2, 8, 30, seed=51)


def _ours(llm, prompts, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


def _hf(model, prompts, **kwargs) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            seq = model.generate(torch.tensor([p]), do_sample=False, pad_token_id=0,
                                 **{"max_new_tokens": N, "min_new_tokens": N, **kwargs})
            outs.append(seq[0, len(p):].tolist())
    return outs


def test_repetition_penalty(llm, llama, prompts):
    # HF's RepetitionPenaltyLogitsProcessor is vLLM's: over prompt and output, divide positives, multiply negatives.
    assert _ours(llm, prompts, repetition_penalty=1.8) == _hf(llama[1], prompts, repetition_penalty=1.8)


def test_presence_and_frequency_penalties(llm, llama, prompts):
    """No HF equivalent: an HF forward per step, vLLM's formula applied by hand, then argmax."""
    presence, frequency, repetition = 1.5, 0.7, 1.2
    ours = _ours(llm, prompts, presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    for prompt, got in zip(prompts, ours):
        seq, out = list(prompt), []
        for _ in range(N):
            with torch.no_grad():
                logits = llama[1](torch.tensor([seq])).logits[0, -1].float()
            counts = Counter(out)
            for tok in set(prompt) | set(out):
                x = logits[tok]
                logits[tok] = x / repetition if x > 0 else x * repetition
            for tok, c in counts.items():
                logits[tok] -= frequency * c + presence
            nxt = int(logits.argmax())
            out.append(nxt)
            seq.append(nxt)
        assert got == out


def test_logit_bias(llm, llama, prompts):
    plain = _ours(llm, prompts)
    target = plain[0][1]
    bias = {target: 0.05, 77: 0.08, 123: -50.0}
    assert _ours(llm, prompts, logit_bias=bias) == _hf(
        llama[1], prompts, sequence_bias={(t,): b for t, b in bias.items()})
    assert all(t == 77 for out in _ours(llm, prompts, logit_bias={77: 100.0}) for t in out)


def test_allowed_token_ids(llm, llama, prompts):
    allowed = list(range(1000, 1040)) + [5]
    ours = _ours(llm, prompts, allowed_token_ids=allowed)
    assert all(t in allowed for out in ours for t in out)
    assert ours == _hf(llama[1], prompts, prefix_allowed_tokens_fn=lambda batch_id, ids: allowed)


def test_bad_words(llm, llama, prompts):
    tok = llm.get_tokenizer()
    plain = _ours(llm, prompts)
    words = [tok.decode([plain[0][0]]).strip() or "x", tok.decode(plain[1][2:4]).strip() or "y"]
    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(tok)
    ours = _ours(llm, prompts, bad_words=words)
    assert ours[0][0] != plain[0][0]
    # HF's NoBadWordsLogitsProcessor also matches word prefixes against the prompt; vLLM (and we) look
    # only at generated tokens. These prompts end in none of the words' prefixes, so the two agree.
    assert ours == _hf(llama[1], prompts, bad_words_ids=params.bad_words_token_ids)
    for out in ours:
        for word in params.bad_words_token_ids:
            assert not any(out[i:i + len(word)] == word for i in range(len(out)))


def test_min_tokens_holds_off_eos_and_stop_tokens(llm, llama, prompts):
    eos = llm.llm_engine.eos_token_id
    stop_tok = 4242
    params = SamplingParams(temperature=0, max_tokens=N, min_tokens=3, logit_bias={eos: 100.0, stop_tok: 99.0})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        assert len(comp.token_ids) == 4 and comp.token_ids[-1] == eos and comp.finish_reason == "stop"
        assert eos not in comp.token_ids[:3]
        hf = _hf(llama[1], [prompt], min_new_tokens=3, max_new_tokens=4,
                 sequence_bias={(eos,): 100.0, (stop_tok,): 99.0})
        assert comp.token_ids == hf[0]
    params = SamplingParams(temperature=0, max_tokens=N, min_tokens=2, stop_token_ids=[stop_tok],
                            logit_bias={stop_tok: 100.0})
    comp = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0].outputs[0]
    assert len(comp.token_ids) == 3 and comp.stop_reason == stop_tok
