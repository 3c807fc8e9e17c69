"""The second grammar library: llguidance, used where xgrammar refuses a constraint (vLLM's `auto`)."""

from __future__ import annotations

import json

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf
import llguidance.torch

from kvserve.structured_output.backend import (
    CompiledGrammar,
    GrammarBackend,
    Matcher,
    without_additional_properties,
)


class GuidanceMatcher(Matcher):
    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str):
        self._m = llguidance.LLMatcher(tokenizer, grammar)

    def accept_token(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    def fill_bitmask(self, bitmask, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()


class GuidanceGrammar(CompiledGrammar):
    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str):
        self.tokenizer = tokenizer
        self.grammar = grammar

    def new_matcher(self) -> Matcher:
        return GuidanceMatcher(self.tokenizer, self.grammar)


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)

    def compile(self, params) -> CompiledGrammar:
        try:
            grammar = self._grammar(params)
        except Exception as e:  # noqa: BLE001 - whatever the library raises, it refused this constraint
            raise ValueError(f"llguidance: {' '.join(str(e).split()) or type(e).__name__}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(f"llguidance: {error.strip()}")
        return GuidanceGrammar(self._tokenizer, grammar)

    @staticmethod
    def _grammar(params) -> str:
        M = llguidance.LLMatcher
        kind = params.kind
        defaults = {"whitespace_flexible": not params.disable_any_whitespace}
        if kind == "json":
            schema = params.json
            if params.disable_additional_properties:
                schema = without_additional_properties(schema)
            return M.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
        if kind == "json_object":
            return M.grammar_from_json_schema('{"type": "object"}', defaults=defaults)
        if kind == "regex":
            return M.grammar_from_regex(params.regex)
        if kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(_lark_literal(s) for s in params.choice))
        if kind == "grammar":
            text = params.grammar
            if "::=" in text:  # GBNF/EBNF: llguidance reads Lark
                text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
            return M.grammar_from_lark(text)
        if kind == "structural_tag":
            raise ValueError("llguidance: structural_tag is compiled by xgrammar only.")
        raise ValueError(f"unknown constraint {kind!r}")
