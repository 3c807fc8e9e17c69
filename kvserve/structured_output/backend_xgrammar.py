"""The default grammar library: xgrammar (vLLM's and SGLang's default)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re

import xgrammar as xgr

from kvserve.structured_output.backend import (
    CompiledGrammar,
    GrammarBackend,
    Matcher,
    legacy_structural_tag,
    without_additional_properties,
)
from kvserve.structured_output.utf8 import ACCEPT, Utf8Guard


logger = logging.getLogger(__name__)

# pyproject.toml's floor: older xgrammar (0.2.7, vLLM 0.26's bundle) fills a JSON schema's string states tens of
# times slower per row, past what a step's forward hides.
MIN_VERSION = (0, 2, 9)


def version() -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", importlib.metadata.version("xgrammar"))[:3])


def _batch_filler():
    """xgrammar's multi-threaded filler (a step's rows are filled in parallel, outside the GIL), made once;
    None where this xgrammar has none."""
    global _BATCH_FILLER
    if _BATCH_FILLER is None and hasattr(xgr, "BatchGrammarMatcher"):
        _BATCH_FILLER = xgr.BatchGrammarMatcher(max(1, min(8, (os.cpu_count() or 2) // 2)))
    return _BATCH_FILLER


_BATCH_FILLER = None


class XgrammarMatcher(Matcher):
    """xgrammar's matcher, its rows ANDed with the UTF-8 guard's for the output's decoder state."""

    def __init__(self, compiled: xgr.CompiledGrammar, guard: Utf8Guard):
        self._m = xgr.GrammarMatcher(compiled)
        self._guard = guard
        self._states = [ACCEPT]  # the decoder state after each accepted token (the last is now's)

    @classmethod
    def fill_bitmasks(cls, matchers: list[Matcher], bitmask, rows: list[int]) -> None:
        filler = _batch_filler() if len(matchers) > 1 else None
        if filler is None:
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        filler.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, rows)
        matchers[0]._guard.apply(bitmask, rows, [m._states[-1] for m in matchers])

    def accept_token(self, token_id: int) -> bool:
        if not self._m.accept_token(token_id):
            return False
        self._states.append(self._guard.advance(self._states[-1], token_id))
        return True

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        self._guard.apply(bitmask, [row], [self._states[-1]])

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)
        del self._states[len(self._states) - num_tokens:]

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class XgrammarGrammar(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar, guard: Utf8Guard):
        self.compiled = compiled
        self.guard = guard

    def new_matcher(self) -> Matcher:
        return XgrammarMatcher(self.compiled, self.guard)


def _message(error: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[20:41:44] /project/cpp/regex_converter.cc:94: ")."""
    text = " ".join(str(error).split())
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text) or type(error).__name__


def _ebnf_literal(text: str) -> str:
    # JSON's string escapes are xgrammar EBNF's.
    return json.dumps(text, ensure_ascii=False)


def _bounded_whitespace(node):
    """disable_any_whitespace inside a structural tag: xgrammar's JSON there takes a bound on whitespace runs,
    not the flag, so each run is at most one character (what keeps a sampled object from filling with it)."""
    if isinstance(node, list):
        return [_bounded_whitespace(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k == "json_schema" else _bounded_whitespace(v)) for k, v in node.items()}
    if out.get("type") == "json_schema":
        out.setdefault("max_whitespace_cnt", 1)
    return out


class XgrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_limit_bytes: int = 256 << 20):
        if version() < MIN_VERSION:
            logger.warning("xgrammar %s is older than %s, which kvserve needs: its masks are far slower to fill "
                           "(constrained steps wait for them).", importlib.metadata.version("xgrammar"),
                           ".".join(map(str, MIN_VERSION)))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=cache_limit_bytes)
        self._guard = Utf8Guard(info.decoded_vocab, vocab_size)

    def compile(self, params) -> CompiledGrammar:
        try:
            return XgrammarGrammar(self._compile(params), self._guard)
        except Exception as e:  # noqa: BLE001 - whatever the library raises, it refused this constraint
            raise ValueError(f"xgrammar: {_message(e)}") from None

    def _compile(self, params) -> xgr.CompiledGrammar:
        c = self._compiler
        kind = params.kind
        any_ws = not params.disable_any_whitespace
        if kind == "json":
            schema = params.json
            if params.disable_additional_properties:
                schema = without_additional_properties(schema)
            return c.compile_json_schema(json.dumps(schema), any_whitespace=any_ws)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=any_ws)  # an object, as OpenAI's
        if kind == "regex":
            return c.compile_regex(params.regex)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(_ebnf_literal(s) for s in params.choice))
        if kind == "grammar":
            try:
                return c.compile_grammar(params.grammar)
            except RuntimeError:
                return c.compile_lark(params.grammar)  # not EBNF: perhaps Lark
        if kind == "structural_tag":
            spec = json.loads(params.structural_tag)
            legacy = legacy_structural_tag(spec)
            if legacy is None:
                if not any_ws:
                    spec = _bounded_whitespace(spec)
                return c.compile_structural_tag(json.dumps(spec))
            structures, triggers = legacy
            tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                    for s in structures]
            return c.compile_structural_tag(tags, triggers)
        raise ValueError(f"unknown constraint {kind!r}")
