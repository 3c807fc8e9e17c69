"""Strict tools under tool_choice "auto" through `kvserve serve`, for every --tool-call-parser: a tiny random
model (temperature 1) is pushed to open a call by a logit bias on its parser's trigger token; from there the
structural tag holds it to the format, so every response carries a call whose arguments validate against the
tool's schema, streamed and not, and the `openai` client parses it."""

from __future__ import annotations

import copy
import json

import httpx
import jsonschema
import pytest
import torch

from tests.conftest import _tiny_config
from tests.server_utils import RemoteServer

# Single tokens for the multi-character triggers, so that one logit bias opens a call.
ADDED_TOKENS = ["<tool_call>", "[TOOL_CALLS]"]
TRIGGER = {"hermes": "<tool_call>", "llama3_json": "{", "mistral": "[TOOL_CALLS]", "pythonic": "["}

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"q": {"type": "string", "pattern": "^[a-z {}\"]{1,12}$"}},
          "required": ["q"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p, "strict": True}}
         for n, p in [("get_weather", WEATHER), ("search", SEARCH)]] + \
        [{"type": "function", "function": {"name": "get_time", "strict": True}}]  # no parameters
SCHEMA_OF = {"get_weather": WEATHER, "search": SEARCH, "get_time": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_with_triggers(tmp_path_factory, smol_tokenizer):
    import transformers

    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.add_tokens(ADDED_TOKENS)
    config = _tiny_config("llama")
    config.vocab_size = len(tokenizer)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama-triggers")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


@pytest.fixture(scope="module", params=list(TRIGGER))
def parser_server(request, model_with_triggers):
    path, tokenizer = model_with_triggers
    srv = RemoteServer(path, "--served-model-name", "tiny", "--max-model-len", "1024", "--disable-log-stats",
                       "--structured-outputs-config", '{"disable_any_whitespace": true}',
                       "--enable-auto-tool-choice", "--tool-call-parser", request.param)
    trigger_ids = tokenizer.encode(TRIGGER[request.param], add_special_tokens=False)
    assert len(trigger_ids) == 1
    yield request.param, srv, trigger_ids[0]
    srv.stop()


def _streamed_calls(srv, body) -> tuple[list[dict], str, str]:
    calls, content, finish = {}, "", None
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                content += c["delta"].get("content") or ""
                for tc in c["delta"].get("tool_calls") or []:
                    cur = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                    cur["name"] += (tc.get("function") or {}).get("name") or ""
                    cur["arguments"] += (tc.get("function") or {}).get("arguments") or ""
                finish = c["finish_reason"] or finish
    return [calls[i] for i in sorted(calls)], content, finish


def test_an_opened_strict_call_always_validates(parser_server):
    parser, srv, trigger = parser_server
    client = srv.openai_client()
    for seed in range(20):
        body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
                "parallel_tool_calls": False, "temperature": 1.0, "max_tokens": 300, "seed": seed,
                "logit_bias": {str(trigger): 100}}
        r = client.chat.completions.create(**body)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (parser, seed, choice)
        calls = [{"name": tc.function.name, "arguments": tc.function.arguments} for tc in choice.message.tool_calls]
        assert len(calls) == 1
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMA_OF[calls[0]["name"]])
        streamed, content, finish = _streamed_calls(srv, body)
        assert (streamed, finish) == (calls, "tool_calls")
        assert content == (choice.message.content or "")


def test_without_the_trigger_the_output_is_free_text(parser_server):
    """No call opened: the tag leaves the text alone (no tool_calls, finish_reason length)."""
    parser, srv, trigger = parser_server
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 1.0, "max_tokens": 8, "seed": 1,
        "logit_bias": {str(trigger): -100}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"]
