"""The batched sampler against plain, row-by-row reference implementations on the same logits."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from kvserve.sampling_params import SamplingParams
from kvserve.worker import sampler
from kvserve.worker.sampler import (apply_logit_edits, apply_min_p, apply_top_k_top_p, gather_logprobs,
                                     processed_probs, sample)
from kvserve.worker.sampling_metadata import build_sampling_metadata

V = 40
NEG = float("-inf")


def _row(params: SamplingParams, prompt=(), output=(), rid="r"):
    """What the runner sees of one request: its ScheduledRequest fields the sampler reads."""
    return SimpleNamespace(request_id=rid, sampling_params=params, prompt_token_ids=list(prompt),
                           output_token_ids=list(output), output_len=len(output))


def _meta(rows, generators=None):
    return build_sampling_metadata(rows, generators or {}, V, torch.device("cpu"))


def _logits(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


# ---- references, one row at a time ------------------------------------------------------------------
def ref_penalties(row: list[float], prompt, output, presence, frequency, repetition) -> list[float]:
    counts = Counter(output)
    out = []
    for tok, x in enumerate(row):
        if tok in counts or tok in prompt:
            x = x / repetition if x > 0 else x * repetition
        x -= frequency * counts[tok] + presence * (counts[tok] > 0)
        out.append(x)
    return out


def ref_top_k(row: list[float], k: int) -> list[float]:
    kth = sorted(row, reverse=True)[k - 1]
    return [x if x >= kth else NEG for x in row]


def ref_top_p(row: list[float], p: float) -> list[float]:
    probs = torch.tensor(row).softmax(-1).tolist()
    keep, mass = set(), 0.0
    for tok in sorted(range(len(row)), key=lambda t: -probs[t]):
        if p < 1 and mass >= p:  # top_p = 1 keeps every token
            break
        keep.add(tok)
        mass += probs[tok]
    return [x if t in keep else NEG for t, x in enumerate(row)]


def ref_min_p(row: list[float], min_p: float) -> list[float]:
    probs = torch.tensor(row).softmax(-1).tolist()
    return [x if probs[t] >= min_p * max(probs) else NEG for t, x in enumerate(row)]


def _close(a: torch.Tensor, b) -> bool:
    b = torch.tensor(b, dtype=a.dtype)
    return bool(torch.equal(torch.isinf(a), torch.isinf(b)) and torch.allclose(a[~a.isinf()], b[~b.isinf()], atol=1e-5))


# ---- logit edits ------------------------------------------------------------------------------------
def test_penalties_match_reference():
    params = [
        SamplingParams(presence_penalty=0.7),
        SamplingParams(),  # untouched row in between
        SamplingParams(frequency_penalty=-0.4, repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=1.5),
    ]
    prompts = [[1, 2, 3], [4], [5, 5, 6, 30], [7, 8]]
    outputs = [[2, 9, 9, 9], [4, 4], [5, 11, 11], [8, 12, 12, 12, 13]]
    rows = [_row(p, pr, o) for p, pr, o in zip(params, prompts, outputs)]
    logits = _logits(4)
    edited = apply_logit_edits(logits.clone(), _meta(rows))
    for i, (p, pr, o) in enumerate(zip(params, prompts, outputs)):
        ref = ref_penalties(logits[i].tolist(), pr, o, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        assert _close(edited[i], ref), i


def test_logit_bias_allowed_tokens_bad_words_min_tokens(smol_tokenizer):
    tok = smol_tokenizer
    # Bad words as the sampler sees them: single-token words and a multi-token one.
    bad = SamplingParams(bad_words=["hello", "x", "Zyxwvutq"])
    bad.update_from_tokenizer(tok)
    params = [
        SamplingParams(logit_bias={3: 5.0, 17: -100.0}),
        SamplingParams(allowed_token_ids=[2, 8, 31]),
        SamplingParams(min_tokens=3, stop_token_ids=[6]),
        SamplingParams(min_tokens=2, stop_token_ids=[6]),  # reached: nothing masked
        SamplingParams(),
    ]
    for p in params:
        p.update_from_model(eos_token_id=2)
    rows = [_row(p, [1], o) for p, o in zip(params, [[4], [], [9, 9], [9, 9], []])]
    logits = _logits(5, seed=1)
    edited = apply_logit_edits(logits.clone(), _meta(rows))
    ref = logits.clone()
    ref[0, 3] += 5.0
    ref[0, 17] -= 100.0
    ref[1] = torch.where(torch.isin(torch.arange(V), torch.tensor([2, 8, 31])), ref[1], NEG)
    ref[2, [2, 6]] = NEG  # EOS and the stop token before min_tokens
    assert torch.equal(edited, ref)

    # Bad words need the real vocabulary: a word's last token is banned once the rest of it was generated.
    vocab = len(tok)
    word_ids = [w for w in bad.bad_words_token_ids]
    multi = next(w for w in word_ids if len(w) >= 2)
    singles = [w[0] for w in word_ids if len(w) == 1]
    rows = [_row(bad, [1], [5]), _row(bad, [1], [5] + multi[:-1])]
    meta = build_sampling_metadata(rows, {}, vocab, torch.device("cpu"))
    edited = apply_logit_edits(torch.zeros(2, vocab), meta)
    banned0 = set(torch.nonzero(edited[0].isinf()).flatten().tolist())
    banned1 = set(torch.nonzero(edited[1].isinf()).flatten().tolist())
    assert banned0 == set(singles)
    assert banned1 == set(singles) | {multi[-1]}


@pytest.mark.parametrize("k", [1, 3, 17, 0])
def test_top_k_matches_reference(k):
    logits = _logits(3, seed=k)
    out = apply_top_k_top_p(logits.clone(), torch.tensor([k, 0, 5]), None)
    refs = [ref_top_k(logits[0].tolist(), k or V), logits[1].tolist(), ref_top_k(logits[2].tolist(), 5)]
    for i in range(3):
        assert _close(out[i], refs[i])


@pytest.mark.parametrize("p", [0.05, 0.3, 0.8, 0.99, 1.0])
def test_top_p_matches_reference(p):
    logits = _logits(4, seed=int(p * 100))
    top_p = torch.tensor([p, 1.0, p, 0.5])
    out = apply_top_k_top_p(logits.clone(), None, top_p)
    for i in range(4):
        assert _close(out[i], ref_top_p(logits[i].tolist(), top_p[i].item())), i


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.2, 0.9])
def test_min_p_matches_reference(min_p):
    logits = _logits(2, seed=3)
    out = apply_min_p(logits.clone(), torch.tensor([min_p, 0.0]))
    assert _close(out[0], ref_min_p(logits[0].tolist(), min_p))
    assert torch.equal(out[1], logits[1])


# ---- the full draw ----------------------------------------------------------------------------------
def test_draws_follow_the_filtered_distribution():
    """Temperature -> min_p -> top_k -> top_p (vLLM's order): empirical frequencies match the reference."""
    params = SamplingParams(temperature=0.7, min_p=0.02, top_k=12, top_p=0.9)
    base = _logits(1, seed=11)[0]
    ref = ref_min_p((base / 0.7).tolist(), 0.02)
    ref = ref_top_k(ref, 12)
    ref = ref_top_p(ref, 0.9)
    ref_probs = torch.tensor(ref).softmax(-1)
    n = 20000
    rows = [_row(params, rid=str(i)) for i in range(n)]
    torch.manual_seed(0)
    tokens = sample(base.expand(n, V).clone(), _meta(rows)).sampled
    freq = torch.bincount(tokens, minlength=V).float() / n
    assert set(tokens.tolist()) <= set(torch.nonzero(ref_probs).flatten().tolist())
    assert torch.allclose(freq, ref_probs, atol=0.015), (freq, ref_probs)


def test_greedy_rows_and_all_greedy_fast_path():
    logits = _logits(3, seed=5)
    rows = [_row(SamplingParams(temperature=t)) for t in (0, 1.0, 0)]
    out = sample(logits.clone(), _meta(rows)).sampled
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    meta = _meta([rows[0], rows[2]])
    assert meta.all_greedy and meta.temperature is None
    assert torch.equal(sample(logits[[0, 2]].clone(), meta).sampled, logits[[0, 2]].argmax(-1))


def test_seeded_row_ignores_the_rest_of_the_batch():
    def draws(batch: int, row: int, steps: int = 5) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        rows = [_row(SamplingParams(temperature=1.0), rid=str(i)) for i in range(batch)]
        out = []
        for step in range(steps):
            logits = _logits(batch, seed=100 + step)
            logits[row] = _logits(1, seed=step)[0]  # the seeded request's logits, wherever it sits
            out.append(sample(logits, _meta(rows, {rows[row].request_id: gen})).sampled[row].item())
        return out

    alone = draws(1, 0)
    assert draws(7, 3) == alone and draws(16, 15) == alone


def test_blocks_of_rows_change_nothing(monkeypatch):
    """The sampler filters and draws a block of rows at a time (its memory stays bounded); blocks of 3 rows
    give the distributions and the seeded draws of one block, and draws still follow the filtered
    distribution."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=i)
              for i, (t, k, p, m) in enumerate([(0.7, 12, 0.9, 0.02), (1.0, 0, 0.5, 0.0), (0, 0, 1.0, 0.0),
                                                 (1.3, 3, 1.0, 0.1), (0.5, 0, 0.95, 0.0), (1.0, 30, 0.7, 0.0),
                                                 (0.9, 5, 0.99, 0.05)])]
    rows = [_row(sp, rid=str(i)) for i, sp in enumerate(params)]
    logits = _logits(len(rows), seed=21)

    def run(block_rows: int):
        monkeypatch.setattr(sampler, "SAMPLER_BLOCK_ELEMENTS", block_rows * V)
        _, probs = processed_probs(logits.clone(), _meta(rows))
        gens = {r.request_id: torch.Generator().manual_seed(7 + i) for i, r in enumerate(rows)}
        return probs, sample(logits.clone(), _meta(rows, gens)).sampled

    one_probs, one_tokens = run(len(rows))
    probs, tokens = run(3)
    assert torch.equal(probs, one_probs) and torch.equal(tokens, one_tokens)
    assert sampler._row_blocks(len(rows), V) == [slice(0, 3), slice(3, 6), slice(6, 7)]

    n = 6000
    base = logits[0]
    torch.manual_seed(0)
    drawn = sample(base.expand(n, V).clone(), _meta([_row(params[0], rid=str(i)) for i in range(n)])).sampled
    freq = torch.bincount(drawn, minlength=V).float() / n
    assert torch.allclose(freq, one_probs[0], atol=0.025), (freq, one_probs[0])


def test_gather_logprobs_matches_log_softmax():
    logits = _logits(4, seed=9)
    ref = logits.log_softmax(-1)
    chosen = torch.tensor([0, 5, 7, int(ref[3].argmax())])
    ids, lps, ranks = gather_logprobs(ref, 3, chosen)
    for i in range(4):
        assert ids[i, 0] == chosen[i] and math.isclose(lps[i, 0].item(), ref[i, chosen[i]].item(), abs_tol=1e-6)
        top = ref[i].topk(3)
        assert ids[i, 1:].tolist() == top.indices.tolist()
        assert ranks[i].item() == 1 + int((ref[i] > ref[i, chosen[i]]).sum())
    assert ranks[3].item() == 1
    only_chosen = gather_logprobs(ref, 0, chosen)
    assert only_chosen[0].shape == (4, 1)


def test_logprobs_come_from_the_raw_distribution():
    """Temperature, penalties and filters shape the draw, not the logprobs returned (vLLM's default)."""
    logits = _logits(2, seed=13)
    params = SamplingParams(temperature=0.5, top_k=2, logprobs=4, repetition_penalty=1.5)
    rows = [_row(params, [1, 2], [3], rid="a"), _row(SamplingParams(temperature=0, logprobs=1), rid="b")]
    out = sample(logits.clone(), _meta(rows))
    raw = logits.log_softmax(-1)
    assert out.logprobs.shape == (2, 5)
    for i in range(2):
        assert torch.allclose(out.logprobs[i, 0], raw[i, out.sampled[i]])
        assert torch.allclose(out.logprobs[i, 1:], raw[i].topk(4).values)
