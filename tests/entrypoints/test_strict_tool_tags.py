"""The structural tag that enforces strict tools under tool_choice "auto", for every tool-call parser: it
accepts the parser's format (text around the calls where the format allows it, parallel calls, a tool with
no parameters, braces and quotes in strings), every accepted call parses back to arguments that validate,
and it refuses a strict call whose arguments break the schema, a call of an unknown tool, a second call when
parallel_tool_calls is false, and any text that opens a call past the grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve.entrypoints.openai.strict_tool_tags import strict_tools_tag
from kvserve.entrypoints.openai.structured_request import Tool
from kvserve.entrypoints.openai.tool_parsers import get_tool_parser
from kvserve.structured_output.params import StructuredOutputsParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "hot": {"type": "boolean"}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"q": {"type": "string"}, "limit": {"type": "integer"}},
          "additionalProperties": False}  # nothing required
TOOLS = [Tool("get_weather", WEATHER, strict=True), Tool("get_time", {"type": "object", "properties": {}}, strict=True),
         Tool("search", SEARCH, strict=True), Tool("free", {"type": "object"}, strict=False)]
SCHEMA_OF = {t.name: t.parameters for t in TOOLS}

GOOD_CALLS = [("get_weather", {"city": "Paris", "days": 3, "hot": True}), ("get_time", {}),
              ("search", {"q": 'a {b} "c" [d]'}), ("search", {}), ("free", {"anything": [1, None]})]
BAD_CALLS = [("get_weather", {"city": "paris", "days": 3}),  # the pattern
             ("get_weather", {"city": "Paris", "days": 9}),  # the maximum
             ("get_weather", {"city": "Paris"}),  # a required property
             ("search", {"q": "x", "extra": 1}),  # additionalProperties
             ("nope", {})]  # not a tool


def _kwargs(args: dict, order) -> str:
    return ", ".join(f"{k}={json.dumps(args[k])}" for k in order if k in args)


def _pythonic_call(name, args):
    schema = SCHEMA_OF.get(name, {})
    required = [p for p in schema.get("properties", {}) if p in schema.get("required", [])]
    order = required + [p for p in args if p not in required]  # the tag writes the required ones first
    return f"{name}({_kwargs(args, order)})"


# parser -> (calls -> the format's text, text before the calls where the format allows it)
FORMATS = {
    "hermes": (lambda calls: "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>'
                                     for n, a in calls), "Let me check. "),
    "llama3_json": (lambda calls: "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls), ""),
    "mistral": (lambda calls: "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls]),
                "Sure. "),
    "mistral-named": (lambda calls: "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls), "Sure. "),
    "pythonic": (lambda calls: "[" + ", ".join(_pythonic_call(n, a) for n, a in calls) + "]", ""),
}


@pytest.fixture(scope="module")
def backend(smol_tokenizer):
    from kvserve.structured_output.backend_xgrammar import XgrammarBackend

    return XgrammarBackend(smol_tokenizer, len(smol_tokenizer), [smol_tokenizer.eos_token_id])


def _accepts(backend, tokenizer, tag: dict, text: str) -> bool:
    """Whether the grammar takes `text`, token by token, and then lets the output end."""
    matcher = backend.compile(StructuredOutputsParams(structural_tag=json.dumps(tag))).new_matcher()
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return all(matcher.accept_token(t) for t in tokens)


def _parser_name(fmt: str) -> str:
    return fmt.split("-")[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_format_is_accepted_and_every_call_validates(backend, smol_tokenizer, fmt):
    write, before = FORMATS[fmt]
    name = _parser_name(fmt)
    tag = strict_tools_tag(name, TOOLS, parallel=True)
    parser = get_tool_parser(name)
    for calls in [GOOD_CALLS, GOOD_CALLS[1:2], GOOD_CALLS[2:3]]:
        for prefix in {"", before}:
            text = prefix + write(calls)
            assert _accepts(backend, smol_tokenizer, tag, text), text
            content, parsed = parser.parse(text)
            assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
            for c in parsed:
                jsonschema.validate(json.loads(c.arguments), SCHEMA_OF[c.name])
    for text in ["", "No call needed.", "  plain text"]:
        assert _accepts(backend, smol_tokenizer, tag, text)
        assert parser.parse(text)[1] == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_strict_call_that_breaks_its_schema_is_refused(backend, smol_tokenizer, fmt):
    write, before = FORMATS[fmt]
    tag = strict_tools_tag(_parser_name(fmt), TOOLS, parallel=True)
    for call in BAD_CALLS:
        assert not _accepts(backend, smol_tokenizer, tag, before + write([call])), call
    # The same arguments for a tool that is not strict are any object.
    assert _accepts(backend, smol_tokenizer, tag, before + write([("free", BAD_CALLS[0][1])]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_parallel_tool_calls_false_allows_one_call(backend, smol_tokenizer, fmt):
    write, before = FORMATS[fmt]
    tag = strict_tools_tag(_parser_name(fmt), TOOLS, parallel=False)
    assert _accepts(backend, smol_tokenizer, tag, before + write(GOOD_CALLS[:1]))
    assert not _accepts(backend, smol_tokenizer, tag, before + write(GOOD_CALLS[:2]))


@pytest.mark.parametrize("name,text", [
    ("llama3_json", ' {"name": "get_weather", "parameters": {}}'),  # leading whitespace still opens a call
    ("llama3_json", '<|python_tag|>{"name": "free", "parameters": {}}'),  # so does the python tag
    ("pythonic", "\n[free(x=1)] and more text"),  # the list is the whole output
    ("pythonic", "<|python_start|>[free(x=1)]"),
    ("mistral", '[TOOL_CALLS][{"name": "free", "arguments": {}}] and more text'),  # calls run to the end
    ("hermes", '<tool_call>\n{"name": "free", "arguments": {}, "x": 1}\n</tool_call>'),
])
def test_no_text_opens_a_call_past_the_grammar(backend, smol_tokenizer, name, text):
    assert not _accepts(backend, smol_tokenizer, strict_tools_tag(name, TOOLS, parallel=True), text)


def test_pythonic_refuses_a_strict_schema_it_cannot_write_as_keywords():
    for params in [{"type": "object", "properties": {"not-an-identifier": {"type": "string"}}},
                   {"anyOf": [{"type": "object"}, {"type": "object"}]}]:
        with pytest.raises(ValueError, match="strict tool 'f'"):
            strict_tools_tag("pythonic", [Tool("f", params, strict=True)], parallel=True)
    strict_tools_tag("pythonic", [Tool("f", {"anyOf": []}, strict=False)], parallel=True)  # not strict: not written
