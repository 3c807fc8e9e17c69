"""The structural tag that enforces `strict` tools under tool_choice "auto", one per --tool-call-parser.

The model writes free text as it likes; once it opens a call in its parser's format (the parser's trigger),
the rest of the call is a grammar: a known tool's name and arguments that match that tool's schema (any
JSON object for a tool not marked strict), in exactly the text the parser reads back. Triggers and formats:
- hermes:      free text, then `<tool_call>` opens {"name", "arguments"} closed by `</tool_call>`; text may follow
- llama3_json: an output that starts with `{` is calls joined by "; ", nothing else
- mistral:     free text, then `[TOOL_CALLS]` opens a JSON list of calls, or name[ARGS]{...} calls, to the end
- pythonic:    an output that starts with `[` is a list of calls with keyword arguments, nothing else
The optional `<|python_tag|>` / `<|python_start|>` openings are not written under the tag (the parsers read
calls without them too), so no output can open a call past the grammar. pythonic's keyword values are JSON
(its parser reads true/false/null as JSON's), one `key=value` per schema property, the required ones first.

The result is xgrammar's structural tag (a dict); with parallel_tool_calls false at most one call is made.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.entrypoints.openai.structured_request import Tool

_ANY_OBJECT = {"type": "object"}
_WS = "[ \\t\\n\\r]"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Top-level keywords a pythonic strict tool's parameters may use: its kwargs are built from properties alone.
_PYTHONIC_TOP_LEVEL = {"type", "properties", "required", "additionalProperties", "$defs", "definitions",
                       "description", "title", "$schema"}


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _json(schema) -> dict:
    return {"type": "json_schema", "json_schema": schema}


def _seq(*elements) -> dict:
    return {"type": "sequence", "elements": list(elements)}


def _or(*elements) -> dict:
    return {"type": "or", "elements": list(elements)}


def _regex(pattern: str) -> dict:
    return {"type": "regex", "pattern": pattern}


def _tag(begin: str, content: dict, end: str = "") -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _calls(tags: list[dict], separator: str, parallel: bool) -> dict:
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
            "stop_after_first": not parallel}


def _arguments_schema(tool: Tool) -> dict:
    return tool.parameters if tool.strict else _ANY_OBJECT


def _class_escape(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else ch


def _regex_escape(ch: str) -> str:
    return "\\" + ch if ch in "\\.^$|?*+()[]{}/" else ch


def _not_starting_with(markers: list[str]) -> str:
    """A regex for the shortest prefixes (after optional whitespace) that start none of `markers`: a text
    that begins so is content to the parser, never a call."""
    def branch(prefixes: list[str], at_start: bool) -> str:
        firsts = sorted({p[0] for p in prefixes if p})
        excluded = "".join(_class_escape(c) for c in firsts) + (" \\t\\n\\r" if at_start else "")
        alternatives = [f"[^{excluded}]"]
        for c in firsts:
            rests = [p[1:] for p in prefixes if p and p[0] == c]
            if all(rests):  # c is not a whole marker: what follows it may still leave every marker
                alternatives.append(_regex_escape(c) + branch(rests, False))
        return "(" + "|".join(alternatives) + ")"

    return f"{_WS}*" + branch(markers, True)


def _text_not_opening(markers: list[str]) -> dict:
    """Any output the parser reads as content: empty or whitespace, or text whose start opens no call."""
    return _or(_regex(f"{_WS}*"), _seq(_regex(_not_starting_with(markers)), {"type": "any_text"}))


def _hermes(tools: list[Tool], parallel: bool) -> dict:
    tags = [_tag(f'<tool_call>\n{{"name": {json.dumps(t.name)}, "arguments": ', _json(_arguments_schema(t)),
                 "}\n</tool_call>") for t in tools]
    return {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags, "stop_after_first": not parallel}


def _llama3_json(tools: list[Tool], parallel: bool) -> dict:
    tags = [_tag(f'{{"name": {json.dumps(t.name)}, "parameters": ', _json(_arguments_schema(t)), "}")
            for t in tools]
    calls = _seq(_regex(f"{_WS}*"), _calls(tags, "; ", parallel))
    return _or(calls, _text_not_opening(["{", "<|python_tag|>"]))


def _mistral(tools: list[Tool], parallel: bool) -> dict:
    one_call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name},
                                                             "arguments": _arguments_schema(t)},
                           "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    as_list = {"type": "array", "items": one_call, "minItems": 1}
    if not parallel:
        as_list["maxItems"] = 1
    named_call = _or(*(_seq(_const(f"{t.name}[ARGS]"), _json(_arguments_schema(t))) for t in tools))
    named = _seq(named_call, {"type": "star", "content": _seq(_const("[TOOL_CALLS]"), named_call)}) if parallel \
        else named_call
    # The calls run to the end of the output: the parser reads everything after the marker as calls.
    opened = _seq(_const("[TOOL_CALLS]"), _or(_json(as_list), named))
    return _seq({"type": "any_text", "excludes": ["[TOOL_CALLS]"]}, {"type": "optional", "content": opened})


def _pythonic_kwargs(tool: Tool) -> dict:
    """`key=value, ...` for the tool's schema: declared properties only, the required ones first (keyword
    order does not matter to a call); any keywords for a tool that is not strict."""
    schema = tool.parameters
    if not tool.strict:
        keyword = _seq(_regex("[A-Za-z_][A-Za-z0-9_]*="), _json(True))
        return _or(_const(""), _seq(keyword, {"type": "star", "content": _seq(_const(", "), keyword)}))
    extra = set(schema) - _PYTHONIC_TOP_LEVEL
    if extra or schema.get("type", "object") != "object":
        raise ValueError(f"tools: the strict tool {tool.name!r} cannot be enforced as pythonic keyword arguments: "
                         f"its parameters use {', '.join(sorted(extra)) or 'a type other than object'}; "
                         f"give it an object schema of properties.")
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what the properties' $refs name
    properties = schema.get("properties") or {}
    for name in properties:
        if not _IDENTIFIER.match(name):
            raise ValueError(f"tools: the strict tool {tool.name!r} has the property {name[:40]!r}, which is not "
                             f"a Python keyword argument name.")
    def keyword(name: str) -> dict:
        value = properties[name]
        if defs and isinstance(value, dict):
            value = {**defs, **value}
        return _seq(_const(f"{name}="), _json(value))

    required = [p for p in properties if p in set(schema.get("required") or ())]
    optional = [p for p in properties if p not in required]
    if required:
        return _seq(keyword(required[0]), *(_seq(_const(", "), keyword(p)) for p in required[1:]),
                    *({"type": "optional", "content": _seq(_const(", "), keyword(p))} for p in optional))
    # No keyword is required: whichever comes first has no comma before it.
    firsts = [_seq(keyword(p), *({"type": "optional", "content": _seq(_const(", "), keyword(q))}
                                 for q in optional[i + 1:])) for i, p in enumerate(optional)]
    return _or(_const(""), *firsts)


def _pythonic(tools: list[Tool], parallel: bool) -> dict:
    tags = [_tag(f"{t.name}(", _pythonic_kwargs(t), ")") for t in tools]
    calls = _seq(_regex(f"{_WS}*\\["), _calls(tags, ", ", parallel), _const("]"))
    return _or(calls, _text_not_opening(["[", "<|python_start|>"]))


_FORMATS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral, "pythonic": _pythonic}


def strict_tools_tag(parser_name: str, tools: list[Tool], parallel: bool) -> dict:
    """The structural tag for `parser_name`'s format over `tools`; ValueError naming a tool it cannot enforce."""
    return {"type": "structural_tag", "format": _FORMATS[parser_name](tools, parallel)}
