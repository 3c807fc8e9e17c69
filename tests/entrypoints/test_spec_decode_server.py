"""Speculative decoding as a server user sees it: each response's usage counts its draft tokens and the
accepted ones (kvserve's addition, like num_preemptions), and /metrics and /dashboard say whether drafts
are on and why, with the mean acceptance length."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server_utils import RemoteServer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = list(range(100, 110)) * 3  # repetitive: the lookups find drafts


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    srv = RemoteServer(path, "--max-model-len", "160", "--num-gpu-blocks-override", "24", "--max-num-seqs", "4",
                       "--speculative-config", json.dumps(NGRAM))
    yield srv
    srv.stop()


def _completion(server, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def test_usage_counts_draft_and_accepted_tokens(server):
    r = _completion(server)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 40
    assert usage["num_draft_tokens"] > 0 and 0 <= usage["num_accepted_tokens"] <= usage["num_draft_tokens"]
    # Streamed with usage: the final chunk carries the same counts (greedy: the same drafts).
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"] == usage


def test_metrics_and_dashboard_show_acceptance_and_why(server):
    assert _completion(server).status_code == 200
    samples = server.metrics()
    drafts = samples['kvserve:spec_decode_num_drafts_total{model_name="' + _model(server) + '"}']
    accepted = samples['kvserve:spec_decode_num_accepted_tokens_total{model_name="' + _model(server) + '"}']
    states = {k: v for k, v in samples.items() if k.startswith("kvserve:spec_decode_state{")}
    assert sum(states.values()) == 1 and len(states) == 5  # one reason at a time, each named
    snap = httpx.get(server.url + "/dashboard/snapshot", timeout=30).json()["speculation"]
    assert snap["acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert snap["reason"] in ("on", "probe", "batch size", "draft cost", "acceptance")
    assert states[f'kvserve:spec_decode_state{{model_name="{_model(server)}",reason="{snap["reason"]}"}}'] == 1


def _model(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
