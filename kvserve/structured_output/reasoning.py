"""Reasoning parsers (--reasoning-parser): where a model's thinking ends and its answer starts.

The thinking sits between <think> and </think>. deepseek_r1's template opens the <think> in the prompt, so
everything before </think> is thinking; qwen3 thinks only in text that starts with <think>. The server splits the text (reasoning_content / content); the engine uses the end marker's token
ids to start a request's constraint after its thinking.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opened_in_prompt: bool  # the template opens <think>: text before </think> is thinking even without <think>

    def thinks(self, text: str) -> bool:
        return self.opened_in_prompt or text.startswith(START)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content or None, content) of a whole output."""
        if not self.thinks(text):
            return None, text
        body = text[len(START):] if text.startswith(START) else text
        reasoning, end, content = body.partition(END)
        return reasoning, content.lstrip("\n") if end else ""

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self)


class ReasoningStreamer:
    """Splits a streamed output into (reasoning delta, content delta) pairs; text that may be the start of
    a marker is held back until it is known not to be."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        self.text += delta
        text = self.text
        if not finished and END not in text:
            text = text[:len(text) - _partial_marker_len(text)]
            if not self.parser.opened_in_prompt and START.startswith(text):
                text = ""  # could still become <think>
        reasoning, content = self.parser.split(text)
        reasoning = reasoning or ""
        r, c = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return r, c


def _partial_marker_len(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of END or START."""
    for marker in (END, START):
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                return n
    return 0


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", opened_in_prompt=True),
    "qwen3": ReasoningParser("qwen3", opened_in_prompt=False),
}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {', '.join(REASONING_PARSERS)}.") from None


def thinking_ended_in(prompt_token_ids: list[int], start_ids: list[int], end_ids: list[int]) -> bool:
    """Whether the prompt already closed the thinking (e.g. a template that turned thinking off)."""
    def last(seq: list[int]) -> int:
        n = len(seq)
        for i in range(len(prompt_token_ids) - n, -1, -1):
            if prompt_token_ids[i:i + n] == seq:
                return i
        return -1

    end = last(end_ids) if end_ids else -1
    return end >= 0 and end > last(start_ids)
