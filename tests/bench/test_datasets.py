"""Benchmark datasets: W1 exactly as docs/DESIGN.md defines it, synthetic sets reproducible from the seed,
ShareGPT sampled and filtered as vLLM does."""

from __future__ import annotations

import json

import pytest

from kvserve.bench import datasets
from kvserve.bench.datasets import build_requests, prefix_requests, random_requests, sharegpt_requests, w1_requests


def test_w1_matches_design_totals():
    reqs = w1_requests()
    assert len(reqs) == 256
    assert sum(r.prompt_len for r in reqs) == 144_581
    assert sum(r.expected_output_len for r in reqs) == 151_597
    assert (reqs[0].prompt_len, reqs[0].expected_output_len) == (964, 494)
    assert all(100 <= t <= 119_999 for r in reqs for t in r.prompt_token_ids)
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in reqs)
    assert [r.prompt_len for r in w1_requests(3)] == [r.prompt_len for r in reqs[:3]]


def test_w1_rejects_small_vocab_and_too_many_prompts():
    with pytest.raises(ValueError, match="w1-llama-8b-dummy"):
        build_requests("w1", num_prompts=None, input_len=None, output_len=None, vocab_size=49152)
    with pytest.raises(ValueError, match="between 1 and 256"):
        w1_requests(257)


def test_w1_config_is_llama_3_1_8b(tmp_path):
    path = datasets.write_w1_config(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert path == str(tmp_path)
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size", "rope_theta")
    assert [cfg[k] for k in shape] == [4096, 32, 32, 8, 14336, 128256, 500000.0]


def test_random_lengths_within_range_and_reproducible():
    a = random_requests(200, 100, 50, 0.25, 1000, seed=7)
    assert a == random_requests(200, 100, 50, 0.25, 1000, seed=7)
    assert a != random_requests(200, 100, 50, 0.25, 1000, seed=8)
    assert all(75 <= r.prompt_len <= 125 and 37 <= r.expected_output_len <= 62 for r in a)
    assert len({r.prompt_len for r in a}) > 10  # lengths really vary
    assert all(len(r.prompt_token_ids) == r.prompt_len and max(r.prompt_token_ids) < 1000 for r in a)
    fixed = random_requests(5, 16, 8, 0.0, 1000, seed=0)
    assert {(r.prompt_len, r.expected_output_len) for r in fixed} == {(16, 8)}
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, 16, 8, 1.0, 1000, seed=0)


def test_prefix_prompts_share_their_prefixes():
    reqs = prefix_requests(12, prefix_len=32, num_prefixes=3, input_len=8, output_len=4, range_ratio=0.0,
                           vocab_size=5000, seed=1)
    assert reqs == prefix_requests(12, 32, 3, 8, 4, 0.0, 5000, seed=1)
    prefixes = {tuple(r.prompt_token_ids[:32]) for r in reqs}
    assert len(prefixes) == 3
    assert all(r.prompt_len == 40 and r.expected_output_len == 4 for r in reqs)
    # Shuffled: the first three requests are not simply prefix 0, 1, 2 in order of construction.
    assert len({tuple(r.prompt_token_ids[32:]) for r in reqs}) == 12


class _WordTokenizer:
    """One token per whitespace-separated word: lengths in the test are easy to read."""

    class _Enc:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text):
        return self._Enc(list(range(len(text.split()))))


def _conv(prompt_words: int, reply_words: int, first="human"):
    return {"conversations": [{"from": first, "value": "w " * prompt_words},
                              {"from": "gpt", "value": "r " * reply_words}]}


def test_sharegpt_first_exchange_lengths_and_filter(tmp_path):
    data = [
        _conv(10, 20),
        _conv(2, 20),  # prompt too short
        _conv(10, 2),  # reply too short
        _conv(1100, 20),  # prompt too long
        _conv(1000, 1100),  # prompt + reply too long
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
        {"conversations": [{"from": "system", "value": "s"}, _conv(5, 6)["conversations"][0],
                           _conv(5, 6)["conversations"][1]]},  # the first human turn need not be first
        _conv(30, 40),
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(path, 3, _WordTokenizer(), seed=0)
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(5, 6), (10, 20), (30, 40)]
    assert all(isinstance(r.prompt, str) and len(r.prompt_token_ids) == r.prompt_len for r in reqs)
    fixed = sharegpt_requests(path, 3, _WordTokenizer(), seed=0, output_len=3)  # --output-len overrides
    assert {r.expected_output_len for r in fixed} == {3}
    with pytest.raises(ValueError, match="only 3 usable"):
        sharegpt_requests(path, 4, _WordTokenizer(), seed=0)
    with pytest.raises(ValueError, match="not a file"):
        sharegpt_requests(tmp_path / "missing.json", 1, _WordTokenizer(), seed=0)


def test_w2_is_long_context_and_fixed():
    from kvserve.bench.datasets import W2_CONFIG, W2_MAX_MODEL_LEN, w2_requests
    from kvserve.model.model_config import ModelConfig

    reqs = w2_requests()
    assert len(reqs) == 64
    assert all(6000 <= r.prompt_len <= 15000 and 128 <= r.expected_output_len <= 512 for r in reqs)
    assert all(r.prompt_len + r.expected_output_len <= W2_MAX_MODEL_LEN for r in reqs)
    assert build_requests("w2", num_prompts=2, input_len=None, output_len=None)[1].prompt_len == reqs[1].prompt_len
    cfg = ModelConfig.from_hf_dict(W2_CONFIG)
    # Gemma-3's 5 windowed layers to 1 full one, the full ones with linear rope scaling.
    assert cfg.layer_windows.count(None) == 8 and cfg.layer_windows.count(1024) == 40
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0} and cfg.rope_local_theta == 10000.0
