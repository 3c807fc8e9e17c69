"""Tool-call parsers (--tool-call-parser): a model's text in, OpenAI `tool_calls` out.

Each parser reads the format its model family was trained to write:
- hermes:      <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, text around them
- llama3_json: {"name": ..., "parameters": {...}} (optionally after <|python_tag|>), several joined by ";"
- mistral:     [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  or  [TOOL_CALLS]name[ARGS]{...}
- pythonic:    [get_weather(city="Paris"), get_time()]  (values Python literals, or JSON's true/false/null)
JSON is read with a real decoder (never by counting braces), so braces and quotes inside string arguments
are just text. Text that does not parse is returned as content, as vLLM does.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id(parser_name: str | None = None) -> str:
    if parser_name == "mistral":  # Mistral's templates insist on 9 alphanumeric characters
        return secrets.token_hex(5)[:9]
    return f"chatcmpl-tool-{secrets.token_hex(12)}"


class ParseError(ValueError):
    pass


def _arguments(value) -> str:
    if value is None:
        value = {}
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            raise ParseError("arguments are not JSON") from None
    if not isinstance(value, dict):
        raise ParseError("arguments are not an object")
    return json.dumps(value, ensure_ascii=False)


def _call(obj, args_keys=("arguments", "parameters")) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ParseError("a call needs a name")
    args = next((obj[k] for k in args_keys if k in obj), None)
    return ToolCall(obj["name"], _arguments(args))


def _json_values(text: str, separator: str | None = None) -> list:
    """Consecutive JSON values in text, separated by whitespace (and `separator`)."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (separator and text[i] == separator)):
            i += 1
        if i >= len(text):
            return values
        value, i = decoder.raw_decode(text, i)
        values.append(value)


class ToolParser:
    name: str
    marker: str  # where calls start
    calls_only_at_start = False  # the format is the whole output, not embedded in text

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls); no calls and the whole text as content when it holds none that parse."""
        start = self.call_start(text)
        if start is None:
            return text, []
        try:
            calls = self._parse_calls(text[start:])
        except (ParseError, ValueError, SyntaxError):
            return text, []
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def call_start(self, text: str) -> int | None:
        if self.calls_only_at_start:
            stripped = len(text) - len(text.lstrip())
            return stripped if text[stripped:].startswith(self.marker) else None
        i = text.find(self.marker)
        return i if i >= 0 else None

    def _parse_calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError


class HermesParser(ToolParser):
    name, marker = "hermes", "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def _parse_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for body in self._block.findall(text):
            values = _json_values(body.strip())
            if len(values) != 1:
                raise ParseError("one JSON object per <tool_call>")
            calls.append(_call(values[0]))
        return calls

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = super().parse(text)
        if calls:  # text between and after the blocks is content too
            rest = self._block.sub("", text).strip()
            content = rest or None
        return content, calls


class Llama3JsonParser(ToolParser):
    name, marker = "llama3_json", "{"
    calls_only_at_start = True

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("<|python_tag|>"):
            return len(text) - len(stripped)
        return super().call_start(text)

    def _parse_calls(self, text: str) -> list[ToolCall]:
        text = text.removeprefix("<|python_tag|>")
        return [_call(v, ("parameters", "arguments")) for v in _json_values(text, separator=";")]


class MistralParser(ToolParser):
    name, marker = "mistral", "[TOOL_CALLS]"
    _named = re.compile(r"\s*([A-Za-z0-9_\-.]+)\[ARGS\]")

    def _parse_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for part in text.split(self.marker)[1:]:
            part = part.strip()
            if part.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
                for values in _json_values(part):
                    if not isinstance(values, list):
                        raise ParseError("a list of calls")
                    calls.extend(_call(v) for v in values)
                continue
            m = self._named.match(part)  # name[ARGS]{...}
            if m is None:
                raise ParseError("unrecognised mistral call")
            values = _json_values(part[m.end():])
            if len(values) != 1:
                raise ParseError("one arguments object per call")
            calls.append(ToolCall(m.group(1), _arguments(values[0])))
        return calls


class PythonicParser(ToolParser):
    name, marker = "pythonic", "["
    calls_only_at_start = True

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("<|python_start|>"):
            return len(text) - len(stripped)
        return super().call_start(text)

    def _parse_calls(self, text: str) -> list[ToolCall]:
        text = text.removeprefix("<|python_start|>").strip()
        text = text.removesuffix("<|python_end|>").strip()
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List):
            raise ParseError("a list of calls")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)) or node.args:
                raise ParseError("calls with keyword arguments only")
            name = ast.unparse(node.func)
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node):
    """A keyword's value: a Python literal, where JSON's true/false/null read as JSON's (models write JSON
    values in calls, and the strict-tool grammar does)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ParseError("no ** in a call's values")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {', '.join(TOOL_PARSERS)}.") from None


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> str | None:
    """The parser name that tool_choice auto uses, or None (auto refused); ValueError for a bad pair of flags."""
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(TOOL_PARSERS)}).")
    return tool_call_parser if enable_auto_tool_choice else None


class ToolCallStreamer:
    """A streamed output under tool_choice auto: text is content until a call starts (text that might be the
    start of the marker is held back); from there on everything is held, and the calls are parsed from the
    whole text when the output ends."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.in_calls = False

    def feed(self, delta: str) -> str:
        """The content that can be sent now."""
        self.text += delta
        if self.in_calls:
            return ""
        text = self.text
        start = self.parser.call_start(text)
        if start is not None:
            self.in_calls = True
            return self._content_up_to(text[:start].rstrip() if start else "")
        if self.parser.calls_only_at_start:
            stripped = text.lstrip()
            if not stripped or any(m.startswith(stripped) for m in (self.parser.marker, "<|python_tag|>",
                                                                      "<|python_start|>")):
                return ""  # could still become a call
            return self._content_up_to(text.rstrip())
        held = _marker_prefix_len(text, self.parser.marker)
        # Trailing whitespace waits too: it is dropped if a call follows it.
        return self._content_up_to(text[:len(text) - held].rstrip())

    def _content_up_to(self, content: str) -> str:
        out = content[self.sent:]
        self.sent = max(self.sent, len(content))
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls) at the end of the output."""
        content, calls = self.parser.parse(self.text)
        if not calls:
            return self._content_up_to(self.text), []
        content = content or ""
        return (content[self.sent:] if content.startswith(self.text[:self.sent]) else ""), calls


def _marker_prefix_len(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0

