"""Prompt-lookup proposals against a brute-force search of the same rule, as tokens arrive in any chunks."""

from __future__ import annotations

import random
from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.spec_decode import ngram_proposer
from kvserve.spec_decode.ngram_proposer import NgramProposer


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix n-gram with an earlier occurrence; the k tokens after its latest one."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def _req(rid, prompt, output):
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, output_token_ids=output)


def _assert_brute_force_drafts_as_tokens_arrive(prompt, chunks, k, min_n, max_n):
    proposer = NgramProposer(k, min_n, max_n)
    output: list[int] = []
    for chunk in [[]] + chunks:
        output.extend(chunk)  # several tokens per step, as after accepted drafts
        got = proposer.propose([_req("a", prompt, output)]).get("a", [])
        assert got == brute_force(prompt + output, k, min_n, max_n)


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(st.integers(0, 4), min_size=1, max_size=40),
       chunks=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=5), max_size=12),
       k=st.integers(1, 6), min_n=st.integers(1, 3), extra_n=st.integers(0, 3))
def test_matches_brute_force_as_tokens_arrive(prompt, chunks, k, min_n, extra_n):
    max_n = min_n + extra_n
    _assert_brute_force_drafts_as_tokens_arrive(prompt, chunks, k, min_n, max_n)


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=60),
       chunks=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=20), max_size=8),
       k=st.integers(1, 4), min_n=st.integers(1, 3), extra_n=st.integers(0, 2))
def test_rebuilds_and_filter_false_positives_keep_the_same_drafts(prompt, chunks, k, min_n, extra_n):
    # Rebuilds (the whole context into the sorted bulk) after every 3 or more new tokens, and a bitmap of
    # one bit per entry that lets most misses through to the search: both must give the brute force's drafts.
    max_n = min_n + extra_n
    with mock.patch.object(ngram_proposer, "REBUILD_MIN_TOKENS", 2), \
            mock.patch.object(ngram_proposer, "REBUILD_RATIO", 10 ** 6), \
            mock.patch.object(ngram_proposer, "FILTER_BITS_PER_KEY", 1):
        _assert_brute_force_drafts_as_tokens_arrive(prompt, chunks, k, min_n, max_n)


def test_large_token_ids_and_a_long_context():
    # Ids past 2^17 (a 128k-token vocabulary): the hash of short n-grams must still reach the key's top bits.
    rng = random.Random(0)
    passage = [rng.randrange(1 << 17, 1 << 18) for _ in range(3000)]
    prompt = passage + [rng.randrange(1 << 18) for _ in range(50)] + passage[1000:1003]
    proposer = NgramProposer(5, 2, 4)
    assert proposer.propose([_req("a", prompt, [])]) == {"a": passage[1003:1008]}
    output = passage[1003:1010]
    assert proposer.propose([_req("a", prompt, output)]) == {"a": passage[1010:1015]}
    output.append(7)
    assert proposer.propose([_req("a", prompt, output)]).get("a", []) == brute_force(prompt + output, 5, 2, 4)


def test_fewer_tokens_per_step_and_several_requests():
    proposer = NgramProposer(4, 1, 3)
    a = _req("a", [1, 2, 3, 4, 5, 6, 1, 2, 3], [])
    b = _req("b", [9, 8, 7], [])
    assert proposer.propose([a, b]) == {"a": [4, 5, 6, 1]}  # b has no repeated n-gram
    assert proposer.propose([a], num_tokens=2) == {"a": [4, 5]}
    a.output_token_ids.extend([4, 5])
    assert proposer.propose([a]) == {"a": [6, 1, 2, 3]}


def test_a_request_that_restarts_is_reindexed():
    proposer = NgramProposer(2, 1, 2)
    assert proposer.propose([_req("a", [1, 2, 1], [2])]) == {"a": [1, 2]}
    # The same id with fewer outputs (a new request reusing the id): its index is rebuilt, not appended to.
    assert proposer.propose([_req("a", [5, 6, 5], [])]) == {"a": [6, 5]}
    proposer.remove("a")
    assert proposer.propose([_req("a", [7, 7], [])]) == {"a": [7]}


@pytest.mark.parametrize("args", [(0, 1, 2), (3, 0, 2), (3, 3, 2)])
def test_bad_settings_are_refused(args):
    with pytest.raises(ValueError):
        NgramProposer(*args)
