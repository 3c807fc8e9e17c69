"""From a choice's generated text to the chat message: thinking to `reasoning_content` (--reasoning-parser),
tool calls to OpenAI's `tool_calls`, the rest to `content`; whole (one response) or streamed (deltas that
join to the same message).

Tool calls by tool_choice: "named": the text is the function's arguments (a grammar made it so);
"required": the text is a JSON list of {name, parameters}; "auto": the --tool-call-parser finds them.
finish_reason becomes "tool_calls" when calls were made (except named, which stays "stop", as in vLLM).
"""

from __future__ import annotations

import json

from kvserve.entrypoints.openai.structured_request import ToolPlan
from kvserve.entrypoints.openai.tool_parsers import ToolCall, ToolCallStreamer, ToolParser, new_call_id
from kvserve.structured_output.reasoning import ReasoningParser


class ChatOutputReader:
    def __init__(self, plan: ToolPlan | None, tool_parser: ToolParser | None, reasoning: ReasoningParser | None):
        self.plan = plan if plan is not None and plan.mode != "none" else None
        self.tool_parser = tool_parser
        self.reasoning = reasoning

    # ---- a whole choice -----------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(message fields: content, reasoning_content, tool_calls; finish_reason)."""
        reasoning, content = self.reasoning.split(text) if self.reasoning is not None else (None, text)
        fields = {"content": content, "tool_calls": []}
        if reasoning is not None:
            fields["reasoning_content"] = reasoning
        calls = self._calls(content, finish_reason)
        if calls is not None:
            content_left, calls = calls
            fields["content"] = content_left
            fields["tool_calls"] = [c.to_openai(new_call_id(self._parser_name)) for c in calls]
            finish_reason = self._finish_with_calls(finish_reason)
        return fields, finish_reason

    @property
    def _parser_name(self) -> str | None:
        return self.tool_parser.name if self.tool_parser is not None else None

    def _finish_with_calls(self, finish_reason):
        if finish_reason == "stop" and self.plan.mode != "named":
            return "tool_calls"
        return finish_reason

    def _calls(self, content: str, finish_reason) -> tuple[str | None, list[ToolCall]] | None:
        plan = self.plan
        if plan is None:
            return None
        if plan.mode == "named":
            return (None, [ToolCall(plan.named, content)]) if finish_reason == "stop" else None
        if plan.mode == "required":
            try:
                calls = [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                         for c in json.loads(content)]
            except (ValueError, TypeError, KeyError):
                return None  # cut short by max_tokens: the text stays content
            return None, calls
        content_left, calls = self.tool_parser.parse(content)
        return (content_left, calls) if calls else None

    # ---- a streamed choice ----------------------------------------------------------------------------
    def streamer(self) -> ChatDeltaStreamer:
        return ChatDeltaStreamer(self)


class ChatDeltaStreamer:
    """One choice's deltas: feed(text delta, finish_reason) -> (list of delta dicts, finish_reason)."""

    def __init__(self, reader: ChatOutputReader):
        self.reader = reader
        self.reasoning = reader.reasoning.streamer() if reader.reasoning is not None else None
        plan = reader.plan
        self.mode = plan.mode if plan is not None else None
        self.tools = ToolCallStreamer(reader.tool_parser) if self.mode == "auto" else None
        self.held = ""  # required: the JSON list, parsed at the end
        self.named_started = False

    def feed(self, delta: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        finished = finish_reason is not None
        out: list[dict] = []
        if self.reasoning is not None:
            reasoning, delta = self.reasoning.feed(delta, finished)
            if reasoning:
                out.append({"reasoning_content": reasoning})
        if self.mode is None:
            if delta:
                out.append({"content": delta})
            return out, finish_reason
        if self.mode == "named":
            return out + self._named(delta), finish_reason
        if self.mode == "required":
            self.held += delta
            if not finished:
                return out, finish_reason
            calls = self.reader._calls(self.held, finish_reason)
            if calls is None:
                return out + ([{"content": self.held}] if self.held else []), finish_reason
            return out + self._call_deltas(calls[1]), self.reader._finish_with_calls(finish_reason)
        content = self.tools.feed(delta)
        if content:
            out.append({"content": content})
        if finished:
            rest, calls = self.tools.finish()
            if rest:
                out.append({"content": rest})
            if calls:
                out += self._call_deltas(calls)
                finish_reason = self.reader._finish_with_calls(finish_reason)
        return out, finish_reason

    def _named(self, delta: str) -> list[dict]:
        """The arguments stream as they are generated; the first delta names the call."""
        if not self.named_started:
            self.named_started = True
            call = {"index": 0, "id": new_call_id(self.reader._parser_name), "type": "function",
                    "function": {"name": self.reader.plan.named, "arguments": delta}}
            return [{"tool_calls": [call]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}] if delta else []

    def _call_deltas(self, calls: list[ToolCall]) -> list[dict]:
        return [{"tool_calls": [{"index": i, **c.to_openai(new_call_id(self.reader._parser_name))}]}
                for i, c in enumerate(calls)]
