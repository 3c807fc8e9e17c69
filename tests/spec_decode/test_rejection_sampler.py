"""Speculative verification: the output distribution is the target's, greedy output and logprobs equal
decoding without drafts, seeded requests stay reproducible."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from kvserve.sampling_params import SamplingParams
from kvserve.worker.spec_verify import DraftTokens, rejection_sample
from kvserve.worker.spec_verify_metadata import build_verify_metadata
from kvserve.worker.sampler import sample
from kvserve.worker.sampling_metadata import build_sampling_metadata

CPU = torch.device("cpu")


def _request(params, prompt=(), output=(), rid="r"):
    return SimpleNamespace(request_id=rid, sampling_params=params, prompt_token_ids=list(prompt),
                           output_token_ids=list(output), output_len=len(output))


def _verify(logits, scheduled, drafts, draft_probs=None, generators=None):
    vocab = logits.shape[-1]
    meta = build_verify_metadata(scheduled, drafts, vocab, CPU)
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
    return rejection_sample(logits.clone(), meta, DraftTokens([len(d) for d in drafts], flat, draft_probs),
                            generators or {})


# ---- distribution ------------------------------------------------------------------------------------
V, K, TRIALS = 6, 3, 40_000


def _target(logits_row: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The target distribution written out: temperature, then keep the top_k logits."""
    x = logits_row / temperature
    kth = x.sort(descending=True).values[top_k - 1]
    return x.masked_fill(x < kth, float("-inf")).softmax(-1)


def _assert_distributed_as(samples: torch.Tensor, expected: torch.Tensor, p_min=1e-3):
    counts = torch.bincount(samples, minlength=len(expected)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token the target never samples was produced"
    exp = expected[support].double() * counts.sum()
    assert chisquare(counts[support], exp * counts[support].sum() / exp.sum()).pvalue > p_min


def _sample_distribution_case(with_draft_probs: bool):
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    pos_logits = torch.randn(K + 1, V, generator=gen) * 1.5  # the target, the same in every context
    params = SamplingParams(temperature=0.8, top_k=4)
    targets = torch.stack([_target(pos_logits[j], 0.8, 4) for j in range(K + 1)])
    # A deliberately wrong draft: it favours what the target rarely or never picks.
    wrong = 1.0 / (targets[:K] + 0.05)
    q = wrong / wrong.sum(-1, keepdim=True)  # [K, V] used for positions 0..K-1
    if with_draft_probs:
        drafts = torch.stack([torch.multinomial(q[j], TRIALS, replacement=True, generator=gen)
                              for j in range(K)], 1)  # [TRIALS, K] drawn from q
    else:  # a deterministic draft (one-hot q): always each position's second most likely token
        drafts = targets[:K].topk(2, dim=-1).indices[:, 1].expand(TRIALS, K).clone()
    logits = pos_logits.repeat(TRIALS, 1)
    draft_probs = q.repeat(TRIALS, 1) if with_draft_probs else None
    scheduled = [_request(params, rid=str(i)) for i in range(TRIALS)]
    out = _verify(logits, scheduled, drafts.tolist(), draft_probs)
    return out, targets, drafts, q


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft-probs", "one-hot"])
def test_output_has_the_target_distribution(with_draft_probs):
    out, targets, drafts, q = _sample_distribution_case(with_draft_probs)
    tokens, n = out.token_ids, out.num_tokens
    _assert_distributed_as(tokens[:, 0], targets[0])
    # Given the first draft was accepted, the second output token follows the next position's target.
    reached = n >= 2
    assert reached.sum() > 2000
    _assert_distributed_as(tokens[reached, 1], targets[1])
    # Power check: the same test refuses the draft's own distribution.
    if with_draft_probs:
        with pytest.raises(AssertionError):
            _assert_distributed_as(drafts[:, 0], targets[0])


def test_accepted_runs_are_prefixes_of_the_drafts():
    out, _, drafts, _ = _sample_distribution_case(True)
    for row, n, draft in zip(out.token_ids.tolist(), out.num_tokens.tolist(), drafts.tolist()):
        assert 1 <= n <= K + 1
        assert row[:n - 1] == draft[:n - 1]
        assert all(t == -1 for t in row[n:])


# ---- greedy ------------------------------------------------------------------------------------------
def test_greedy_accepts_until_the_first_mismatch():
    logits = torch.randn(5 + 1 + 3, 10, generator=torch.Generator().manual_seed(3))  # k_i + 1 rows each
    best = logits.argmax(-1).tolist()
    greedy = SamplingParams(temperature=0)
    drafts = [[best[0], best[1], (best[2] + 1) % 10, best[3]],  # the third draft is wrong
              [],  # no drafts: one plain token
              [best[6], best[7]]]  # all right: the bonus token follows
    out = _verify(logits, [_request(greedy, rid=r) for r in "abc"], drafts)
    assert out.to_lists() == [[best[0], best[1], best[2]], [best[5]], [best[6], best[7], best[8]]]


# ---- seeds -------------------------------------------------------------------------------------------
def test_seeded_request_reproducible_whatever_the_batch():
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(4))
    seeded = SamplingParams(temperature=1.0, seed=7)
    draft = logits[:2].argmin(-1).tolist()  # unlikely drafts: rejections and recoveries
    alone = [_verify(logits, [_request(seeded)], [draft],
                     generators={0: torch.Generator().manual_seed(7)}).to_lists()[0] for _ in range(3)]
    other = SamplingParams(temperature=1.0)
    batch_logits = torch.cat([torch.randn(2, 12), logits])
    in_batch = _verify(batch_logits, [_request(other, rid="x"), _request(seeded)], [[1], draft],
                       generators={1: torch.Generator().manual_seed(7)}).to_lists()[1]
    assert alone[0] == alone[1] == alone[2] == in_batch
    many = {tuple(_verify(logits, [_request(seeded)], [draft], generators={0: torch.Generator().manual_seed(s)})
                  .to_lists()[0]) for s in range(40)}
    assert len(many) > 1  # the seed, not a constant, decides


def test_no_drafts_draws_what_the_plain_sampler_draws():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=s) for s in range(5)]
    rows = [_request(p, rid=str(i)) for i, p in enumerate(params)]
    plain = sample(logits.clone(), build_sampling_metadata(
        rows, {str(i): torch.Generator().manual_seed(i) for i in range(5)}, 30, CPU)).sampled.tolist()
    spec = _verify(logits, rows, [[] for _ in range(5)],
                   generators={i: torch.Generator().manual_seed(i) for i in range(5)}).to_lists()
    assert [t[0] for t in spec] == plain


# ---- against decoding without drafts, on a toy model ------------------------------------------------
TOY_V = 24


def _toy_logits(context: list[int]) -> torch.Tensor:
    """A deterministic 'model': the next-token logits are a function of the whole context."""
    seed = hash(tuple(context)) % (2 ** 31)
    return torch.randn(TOY_V, generator=torch.Generator().manual_seed(seed)) * 2


def _plain_decode(prompt, params, steps):
    out, lps = [], []
    for _ in range(steps):
        row = _request(params, prompt, out)
        res = sample(_toy_logits(prompt + out)[None], build_sampling_metadata([row], {}, TOY_V, CPU))
        out.append(res.sampled.item())
        lps.append(res.logprobs[0].tolist())
    return out, lps


def _spec_decode(prompt, params, steps, draft_for):
    out, lps, num_steps = [], [], 0
    while len(out) < steps:
        draft = draft_for(len(out))
        contexts = [prompt + out + draft[:j] for j in range(len(draft) + 1)]
        logits = torch.stack([_toy_logits(c) for c in contexts])
        res = _verify(logits, [_request(params, prompt, out)], [draft])
        out += res.to_lists()[0]
        lps += res.logprobs.tolist()
        num_steps += 1
    return out[:steps], lps[:steps], num_steps


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, logprobs=3),
    SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.3),
    SamplingParams(temperature=0, logprobs=1, min_tokens=9, stop_token_ids=[0, 1, 2, 3], logit_bias={5: 3.0}),
], ids=["plain", "penalties", "min-tokens-bias"])
def test_same_greedy_tokens_and_logprobs_as_without_drafts(params):
    prompt, steps = [7, 3, 9, 3, 11], 30
    ref, ref_lps = _plain_decode(prompt, params, steps)
    pattern = torch.Generator().manual_seed(6)

    def draft_for(n: int) -> list[int]:  # the next 4 reference tokens, some of them replaced by wrong ones
        draft = ref[n:n + 4]
        wrong = torch.rand(len(draft), generator=pattern) < 0.3
        return [(t + 1) % TOY_V if w else t for t, w in zip(draft, wrong.tolist())]

    out, lps, num_steps = _spec_decode(prompt, params, steps, draft_for)
    assert out == ref
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps))
    assert num_steps < steps  # drafts were accepted, not only bonus tokens
