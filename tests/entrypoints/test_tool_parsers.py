"""Each tool-call parser's documented format round-trips (text in, tool_calls out), whole and streamed in
pieces of every size, including what breaks parsers elsewhere: a call with empty arguments followed by
another, braces and quotes inside string arguments, a tool with no parameters, parallel calls."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallStreamer, get_tool_parser

TRICKY = {"q": 'say "hi" {not json} [x]', "n": 3}
CALLS = [("get_time", {}), ("search", TRICKY), ("ping", {}), ("weather", {"city": "Paris", "days": [1, 2]})]


def _hermes(calls, before="Let me check.", after=""):
    blocks = "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n' for n, a in calls)
    return f"{before}\n{blocks}{after}", before or None


def _llama3(calls):
    return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls), None


def _mistral_list(calls, before="Sure."):
    return before + "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls]), before


def _mistral_named(calls):
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls), None


def _pythonic(calls):
    def kw(a):
        return ", ".join(f"{k}={v!r}" for k, v in a.items())
    return "[" + ", ".join(f"{n}({kw(a)})" for n, a in calls) + "]", None


FORMATS = [("hermes", _hermes), ("llama3_json", _llama3), ("mistral", _mistral_list), ("mistral", _mistral_named),
           ("pythonic", _pythonic)]


def _streamed(parser, text, step):
    st = ToolCallStreamer(parser)
    content = "".join(st.feed(text[i:i + step]) for i in range(0, len(text), step))
    rest, calls = st.finish()
    return (content + rest) or None, calls


@pytest.mark.parametrize("name,fmt", FORMATS, ids=[f"{n}-{f.__name__}" for n, f in FORMATS])
@pytest.mark.parametrize("calls", [CALLS, CALLS[:1], CALLS[1:2]], ids=["parallel", "no-params", "tricky"])
def test_round_trip(name, fmt, calls):
    parser = get_tool_parser(name)
    text, content = fmt(calls)
    expected = [(n, a) for n, a in calls]
    for got_content, got_calls in [parser.parse(text)] + [_streamed(parser, text, k) for k in (1, 3, 7, 1000)]:
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == expected
        assert (got_content or None) == (content.strip() if content else None)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_plain_text_is_content(name):
    parser = get_tool_parser(name)
    for text in ["Just an answer.", "The list [1, 2] and {braces}.", ""]:
        for content, calls in [parser.parse(text), _streamed(parser, text, 2)]:
            assert calls == [] and (content or "") == text


def test_unparsable_calls_stay_content():
    parser = get_tool_parser("hermes")
    text = "x <tool_call>{not json</tool_call>"
    assert parser.parse(text) == (text, [])
    assert _streamed(parser, text, 4) == (text, [])


def test_hermes_text_after_the_calls():
    text, _ = _hermes(CALLS[:2], before="Before.", after="After.")
    content, calls = get_tool_parser("hermes").parse(text)
    assert content == "Before.\nAfter." or content.split() == ["Before.", "After."]
    assert len(calls) == 2


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
