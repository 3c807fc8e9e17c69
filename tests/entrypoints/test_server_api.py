"""The OpenAI-compatible server, driven by the official `openai` client (one tiny-llama server for the module,
started with an API key) and by raw httpx for the error cases."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server_utils import RemoteServer

API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    srv = RemoteServer(path, "--served-model-name", "tiny", "--max-num-seqs", "64", api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def _assert_healthy(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---- happy paths -----------------------------------------------------------------------------------
def test_models_and_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].object == "model"
    assert models.data[0].model_extra["max_model_len"] == 1024
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion(client):
    r = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=5, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny"
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_completion_batch_of_token_ids_with_n(client):
    prompts = [[1, 450, 4996, 17354], [1, 1724, 338]]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=3, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 12
    # Strings in a list work too.
    r = client.completions.create(model="tiny", prompt=["a", "b c"], max_tokens=2, temperature=0)
    assert len(r.choices) == 2


def test_completion_echo_and_logprobs(client):
    prompt = "Once upon a time"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=2, temperature=0)
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n = r.usage.prompt_tokens + 4
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None  # nothing predicts the first prompt token
    for chosen, top in zip(lp.token_logprobs[r.usage.prompt_tokens:], lp.top_logprobs[r.usage.prompt_tokens:]):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert abs(max(top.values()) - chosen) < 1e-4  # greedy: the chosen token is the most likely


def test_chat(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4,
                                       temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_chat_stream_equals_non_stream_multi_turn(server, client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "text", "text": "Another one?"}]},
    ]
    full = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # The prompt is exactly the chat template's rendering: /tokenize agrees on its length.
    tok = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=server.headers()).json()
    assert tok["count"] == full.usage.prompt_tokens


def test_chat_n_and_seed_reproducible(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6, n=2,
                  temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content  # seed + i per sample
    streamed = list(client.chat.completions.create(**kwargs, stream=True))
    texts = {0: "", 1: ""}
    for c in streamed:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in a.choices]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       logprobs=True, top_logprobs=3, temperature=0)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-4  # greedy picks the top token
        assert entry.bytes == list(entry.token.encode())


def test_stop_string(client):
    base = client.completions.create(model="tiny", prompt="Stop test", max_tokens=10, temperature=0, logprobs=0)
    text, offsets = base.choices[0].text, base.choices[0].logprobs.text_offset
    stop = text[offsets[3]:offsets[4]]  # the 4th token's text
    assert stop
    r = client.completions.create(model="tiny", prompt="Stop test", max_tokens=10, temperature=0, stop=[stop])
    assert r.choices[0].text == text[:text.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = client.completions.create(model="tiny", prompt="Stop test", max_tokens=10, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_vllm_sampling_extras(client):
    r = client.completions.create(
        model="tiny", prompt="Extras", max_tokens=6, temperature=0.8, seed=0,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 6,
                    "stop_token_ids": [2]},
    )
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_tokenize_detokenize(server):
    h = server.headers()
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "hello world", "add_special_tokens": False},
                     headers=h).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    detok = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=h).json()
    assert detok["prompt"] == "hello world"


def test_metrics_names(server, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=2)
    names = set(server.metrics())
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "iteration_tokens_total_bucket"):
        assert any(n.startswith("kvserve:" + name + "{") for n in names), name
    assert server.metric("kvserve:generation_tokens_total") >= 2


# ---- errors: OpenAI JSON, right status, server stays healthy ---------------------------------------
def _post(server, path, body, headers=None):
    headers = server.headers() if headers is None else headers
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={**headers, "Content-Type": "application/json"},
                      timeout=60)


@pytest.mark.parametrize("path,body,status,fragment", [
    ("/v1/completions", "{not json", 400, "JSON"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": "two"}, 400, "n"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "gpt-4"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "logprobs"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "nope"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 10**9]}, 400, "vocabulary"),
    ("/v1/nothing-here", {}, 404, ""),
])
def test_bad_requests(server, path, body, status, fragment):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert fragment in err["message"] or fragment == err["param"]
    _assert_healthy(server)


def test_too_long_prompt(server):
    long_prompt = [5] * 1000
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": long_prompt, "max_tokens": 100})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "This model's maximum context length is 1024 tokens. However, you requested 1100 tokens "
        "(1000 in the messages, 100 in the completion). Please reduce the length of the messages or completion.")
    r = _post(server, "/v1/chat/completions",
              {"model": "tiny", "messages": [{"role": "user", "content": "word " * 1100}]})
    assert r.status_code == 400 and "maximum context length is 1024" in r.json()["error"]["message"]
    _assert_healthy(server)


def test_api_key(server):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = _post(server, "/v1/completions", body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert _post(server, "/v1/completions", body).status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    # Probes and scrapers stay open, as in vLLM.
    assert httpx.get(server.url + "/metrics").status_code == 200
    _assert_healthy(server)


def test_openai_client_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=0)
    assert "max_tokens" in str(e.value)


def test_chat_top_logprobs_minus_one_is_the_whole_vocabulary_as_in_vllm(server):
    msg = [{"role": "user", "content": "x"}]
    # -1 passes the API's rules and meets the operator's cap (--max-logprobs 20 here), which names its flag.
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": msg, "logprobs": True, "top_logprobs": -1})
    assert r.status_code == 400 and "--max-logprobs -1" in r.json()["error"]["message"], r.text
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": msg, "logprobs": True, "top_logprobs": -2})
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"], r.text
    # 0 returns no alternatives, so it needs no logprobs flag; completions' logprobs has no -1 (as vLLM).
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": msg, "top_logprobs": 0, "max_tokens": 1})
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": -1})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"], r.text
    _assert_healthy(server)


def test_chat_logprobs_format_minus_one_lists_every_alternative():
    from kvserve.entrypoints.openai.serving_base import chat_logprobs
    from kvserve.outputs import Logprob

    entries = {7: Logprob(-0.5, 1, "a"), 8: Logprob(-1.5, 2, "b"), 9: Logprob(-2.5, 3, "c")}
    (whole,) = chat_logprobs([7], [entries], -1, None)
    assert [t["token"] for t in whole["top_logprobs"]] == ["a", "b", "c"]
    (two,) = chat_logprobs([7], [entries], 2, None)
    assert [t["token"] for t in two["top_logprobs"]] == ["a", "b"]
