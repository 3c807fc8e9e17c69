"""Structured outputs and tool calling through `kvserve serve` (tiny random model, temperature 1), driven by
the official `openai` client and raw httpx: every constrained output holds, streamed and not; required and
named tool choices always carry a call whose arguments validate; the hermes parser's format round-trips under
tool_choice auto; reasoning_content; every refused input is a 400 with OpenAI's error JSON."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.server_utils import RemoteServer
from tests.structured_schemas import SCHEMAS

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "pattern": "^[a-z {}\"]{1,12}$"}}, "required": ["q"]}}},
]
SCHEMA_OF = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    srv = RemoteServer(path, "--served-model-name", "tiny", "--max-model-len", "1024", "--disable-log-stats",
                       "--structured-outputs-config", '{"disable_any_whitespace": true}',
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reasoning_server(tiny_model_factory):
    """A reasoning model's server without auto tool choice."""
    path, _ = tiny_model_factory("llama")
    srv = RemoteServer(path, "--served-model-name", "tiny", "--max-model-len", "512", "--disable-log-stats",
                       "--reasoning-parser", "deepseek_r1")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120)


def _stream(server, path, body) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _loads(text):
    return json.loads(text, strict=False)  # see tests/structured_output/test_structured_outputs.py: xgrammar's bounded strings


def _content(message) -> str:
    return message.content or ""


def test_response_format_json_schema_chat_and_completions(client):
    for schema in SCHEMAS[:12]:
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=rf, temperature=1.0,
                                           max_tokens=200, n=2)
        for c in r.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(_loads(c.message.content), schema)
        r = client.completions.create(model="tiny", prompt="JSON:", max_tokens=200, temperature=1.0,
                                      extra_body={"response_format": rf})
        jsonschema.validate(_loads(r.choices[0].text), schema)


def test_vllm_fields_on_completions(server):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 60, "temperature": 1.0, "n": 4}
    for extra, check in [
        ({"guided_regex": r"[a-c]{2,4}-\d{2}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-\d{2}", t)),
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"guided_json": SCHEMAS[1]}, lambda t: jsonschema.validate(_loads(t), SCHEMAS[1]) is None),
        ({"guided_grammar": 'root ::= "a"+ "b"'}, lambda t: re.fullmatch("a+b", t)),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t)),
        ({"structured_outputs": {"choice": ["x", "y"]}, "guided_decoding_backend": "auto"}, lambda t: t in "xy"),
        ({"response_format": {"type": "json_object"}, "max_tokens": 40}, lambda t: t.startswith("{")),
    ]:
        r = _post(server, "/v1/completions", {**body, **extra})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert check(c["text"]), (extra, c["text"])


def test_streaming_deltas_join_to_the_non_streamed_text(server):
    for path, body in [
        ("/v1/completions", {"prompt": "x", "guided_json": SCHEMAS[31]}),
        ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"json": SCHEMAS[13]}}),
    ]:
        body = {"model": "tiny", "max_tokens": 200, "temperature": 1.0, "seed": 7, **body}
        whole = _post(server, path, body).json()["choices"][0]
        chunks = _stream(server, path, body)
        if path == "/v1/completions":
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["text"]
        else:
            delta = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert delta == whole["message"]["content"]


def test_reasoning_content_and_the_constraint_after_thinking(reasoning_server):
    """deepseek_r1: text before </think> is thinking (reasoning_content, streamed too) and is not constrained;
    once the prompt has closed the thinking, the answer is constrained and is content."""
    client = reasoning_server.openai_client()
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "seed": 5,
            "structured_outputs": {"regex": "[0-9]{2}"}}
    whole = _post(reasoning_server, "/v1/chat/completions", body).json()["choices"][0]
    thought = whole["message"]["reasoning_content"]
    assert whole["finish_reason"] == "length" and len(thought) > 2 and not whole["message"]["content"]
    chunks = _stream(reasoning_server, "/v1/chat/completions", body)
    assert "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]) == thought
    msgs = MESSAGES + [{"role": "assistant", "content": "<think>easy</think>"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=50, temperature=1.0,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{2}"},
                                                   "continue_final_message": True, "add_generation_prompt": False})
    assert re.fullmatch("[0-9]{2}", r.choices[0].message.content)


def _calls_of_stream(chunks):
    calls, finish = {}, None
    for ch in chunks:
        for c in ch["choices"]:
            for tc in c["delta"].get("tool_calls") or []:
                cur = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                cur["name"] += fn.get("name") or ""
                cur["arguments"] += fn.get("arguments") or ""
            finish = c["finish_reason"] or finish
    return [calls[i] for i in sorted(calls)], finish


def test_required_and_named_tool_choice_always_call(server, client):
    """20 of 20, streamed and not: the same seed gives the same calls both ways, and every call validates."""
    for choice, expected_finish in [("required", "tool_calls"),
                                    ({"type": "function", "function": {"name": "get_weather"}}, "stop")]:
        for seed in range(20):
            body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
                    # A random model may list many calls before it closes the list: room for them.
                    "temperature": 1.0, "max_tokens": 800, "seed": seed}
            r = client.chat.completions.create(**body)
            calls = [{"name": tc.function.name, "arguments": tc.function.arguments}
                     for tc in r.choices[0].message.tool_calls]
            assert all(tc.id and tc.type == "function" for tc in r.choices[0].message.tool_calls)
            assert r.choices[0].finish_reason == expected_finish and calls
            streamed, finish = _calls_of_stream(_stream(server, "/v1/chat/completions", body))
            assert finish == expected_finish and streamed == calls
            for call in calls:
                if isinstance(choice, dict):
                    assert call["name"] == "get_weather"
                jsonschema.validate(_loads(call["arguments"]), SCHEMA_OF[call["name"]])


def test_parallel_tool_calls_false_makes_one_call(client):
    for seed in range(5):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, max_tokens=200, seed=seed)
        assert len(r.choices[0].message.tool_calls) == 1


HERMES_TEXT = ('Checking.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
               '<tool_call>\n{"name": "search", "arguments": {"q": "a {b} \\"c\\""}}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_hermes_format(server, client, stream):
    """The model is made to write hermes' format (a choice constraint); the server hands back tool_calls."""
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 1.0,
            "structured_outputs": {"choice": [HERMES_TEXT]}}
    if stream:
        chunks = _stream(server, "/v1/chat/completions", body)
        calls, finish = _calls_of_stream(chunks)
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert content == "Checking."
    else:
        r = client.chat.completions.create(**{k: v for k, v in body.items() if k != "structured_outputs"},
                                           extra_body={"structured_outputs": body["structured_outputs"],
                                                       "chat_template_kwargs": {}})
        calls = [{"name": tc.function.name, "arguments": tc.function.arguments}
                 for tc in (r.choices[0].message.tool_calls or [])]
        finish = r.choices[0].finish_reason
        assert r.choices[0].message.content == "Checking."
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {}),
                                                                          ("search", {"q": 'a {b} "c"'})]


def test_tool_round_trip_history_renders(client):
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=3)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=5)
    assert r.choices[0].finish_reason == "length"


REFUSED = [
    {"guided_json": {"type": "foo"}},
    {"guided_regex": "("},
    {"guided_grammar": 'root ::= ("a"'},
    {"guided_json": "{not json"},
    {"guided_regex": "a", "guided_choice": ["a"]},
    {"guided_regex": "a", "response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    {"structured_outputs": {"unknown": 1}},
    {"structured_outputs": {}},
    {"structured_outputs": "a+"},
    {"guided_choice": []},
    {"guided_decoding_backend": "outlines", "guided_regex": "a"},
    {"guided_whitespace_pattern": " "},
    {"response_format": {"type": "xml"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}},
    {"guided_regex": "a" * 70000},
]
REFUSED_CHAT = [
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": TOOLS, "tool_choice": "sometimes"},
    {"tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]},
    {"tools": [{"type": "retrieval"}]},
    {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
]


def test_refused_inputs_are_400_and_the_server_stays_healthy(server):
    for extra in REFUSED:
        for path, base in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})]:
            r = _post(server, path, {"model": "tiny", "max_tokens": 5, **base, **extra})
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] and err["code"] == 400
    for extra in REFUSED_CHAT:
        r = _post(server, "/v1/chat/completions", {"model": "tiny", "max_tokens": 5, "messages": MESSAGES, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 5, "guided_regex": "ok"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"


def test_auto_needs_the_flags(reasoning_server):
    srv = reasoning_server
    r = _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                                            "tool_choice": "none", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []
