"""A request's output constraint, from whichever field states it: OpenAI's `response_format`, vLLM's
`structured_outputs` object, vLLM's older `guided_*` fields, or the tools (`tool_choice` required or named:
a grammar built from the tools' schemas, so the call always parses; `auto` with a `strict` tool: a
structural tag in the --tool-call-parser's format that enforces the call once the model opens one).

Everything here is a ValueError whose message starts with the field it is about (the server's 400).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.structured_output.compiler import BACKENDS
from kvserve.request_limits import check_num_tools
from kvserve.structured_output.params import StructuredOutputsParams

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class Tool:
    name: str
    parameters: dict
    strict: bool = False


@dataclass
class ToolPlan:
    """How the chat response reads the output: "none" (text), "auto" (a parser finds calls), "required" (a
    JSON list of {name, parameters}) or "named" (the output is the named function's arguments)."""

    mode: str
    tools: list[Tool]
    named: str | None = None


def parse_tools(tools: list | None) -> list[Tool]:
    if not tools:
        return []
    check_num_tools(len(tools))
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}.")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string of at most 64 characters.")
        if name in seen:
            raise ValueError(f"tools has two functions named {name!r}.")
        seen.add(name)
        params = fn.get("parameters") or _EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object.")
        strict = fn.get("strict", False)
        out.append(Tool(name, params, bool(strict)))
    return out


def tool_plan(tools: list | None, tool_choice, auto_enabled: bool) -> ToolPlan:
    parsed = parse_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if parsed else "none"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                             '"function": {"name": ...}}.')
        if name not in {t.name for t in parsed}:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools.")
        return ToolPlan("named", parsed, name)
    if tool_choice not in ("none", "auto", "required"):
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", ...}.')
    if tool_choice != "none" and not parsed:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools.")
    if tool_choice == "auto" and not auto_enabled:
        raise ValueError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                         '--tool-call-parser; use "required" or a named function, which need neither.')
    return ToolPlan(tool_choice, parsed)


def _tool_constraint(plan: ToolPlan, parallel_tool_calls: bool, parser_name: str | None):
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t.name == plan.named)
        return StructuredOutputsParams(json=tool.parameters)
    if plan.mode == "required":
        one_call = {"anyOf": [
            {"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.parameters},
             "required": ["name", "parameters"]} for t in plan.tools]}
        schema = {"type": "array", "items": one_call, "minItems": 1}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    if plan.mode == "auto" and parser_name is not None and any(t.strict for t in plan.tools):
        import json

        from kvserve.entrypoints.openai.strict_tool_tags import strict_tools_tag

        return StructuredOutputsParams(structural_tag=json.dumps(
            strict_tools_tag(parser_name, plan.tools, parallel_tool_calls)))
    return None


def _response_format(rf) -> StructuredOutputsParams | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError('response_format.json_schema must be {"name": ..., "schema": {...}, "strict": ...}.')
        return StructuredOutputsParams(json=spec.get("schema") or {"type": "object"})
    if kind == "structural_tag":
        import json

        return StructuredOutputsParams(structural_tag=json.dumps(rf))
    raise ValueError(f"response_format.type {str(kind)[:40]!r} is not one of text, json_object, json_schema, "
                     f"structural_tag.")


def _guided(req) -> tuple[StructuredOutputsParams | None, str | None]:
    given = [name for name in GUIDED_FIELDS if getattr(req, name, None) is not None]
    if len(given) > 1:
        raise ValueError(f"{given[0]} cannot be combined with {given[1]}: give one constraint.")
    if not given:
        return None, None
    name = given[0]
    value = getattr(req, name)
    key = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
    try:
        return StructuredOutputsParams(**{key[name]: value}), name
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def request_constraint(req, plan: ToolPlan | None = None, parser_name: str | None = None,
                       server_backend: str = "auto") -> StructuredOutputsParams | None:
    """The one constraint the request asks for, or None; ValueError when it asks for two or states one wrongly."""
    backend = getattr(req, "guided_decoding_backend", None)
    # As vLLM: the server's backend decides; a request may name it, or any backend when the server's is auto.
    if backend is not None and (backend not in BACKENDS or
                                (server_backend != "auto" and backend not in ("auto", server_backend))):
        raise ValueError(f"guided_decoding_backend {str(backend)[:40]!r}: this server uses {server_backend!r} "
                         f"(--structured-outputs-config); leave the field out.")
    sources = []
    if getattr(req, "structured_outputs", None) is not None:
        try:
            sources.append(("structured_outputs", StructuredOutputsParams.from_dict(req.structured_outputs)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs: {str(e).removeprefix('structured_outputs ')}") from None
    guided, name = _guided(req)
    if guided is not None:
        sources.append((name, guided))
    try:
        rf = _response_format(getattr(req, "response_format", None))
    except ValueError as e:
        raise ValueError(f"response_format: {e}".replace("response_format: response_format", "response_format"))
    if rf is not None:
        sources.append(("response_format", rf))
    if plan is not None:
        tool = _tool_constraint(plan, getattr(req, "parallel_tool_calls", True) is not False, parser_name)
        if tool is not None:
            sources.append(("tool_choice", tool))
    if len(sources) > 1:
        raise ValueError(f"{sources[0][0]} cannot be combined with {sources[1][0]}: give one constraint.")
    return sources[0][1] if sources else None
