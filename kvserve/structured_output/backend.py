"""The interface every grammar library is used through: compile a constraint once, then one matcher per
sequence that accepts tokens, fills its row of the token bitmask and rolls back.

`rollback(n)` serves speculative decoding: a step's mask rows for draft tokens are filled by advancing
over the drafts, then rolling back. Preemption needs none: a preempted request keeps its output tokens and
so its matcher's state.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod


class Matcher(ABC):
    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advances by one token; False if the grammar does not allow it (the state is then unchanged)."""

    @abstractmethod
    def fill_bitmask(self, bitmask, row: int) -> None:
        """Writes the allowed next tokens into row `row` of an int32 [rows, ceil(vocab / 32)] CPU tensor."""

    @classmethod
    def fill_bitmasks(cls, matchers: list[Matcher], bitmask, rows: list[int]) -> None:
        """Row rows[i] for matchers[i], all of this class: a library that fills many at once does so."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has ended (its stop token was accepted): the request is done."""


class CompiledGrammar(ABC):
    @abstractmethod
    def new_matcher(self) -> Matcher: ...


class GrammarBackend(ABC):
    name: str

    @abstractmethod
    def compile(self, params) -> CompiledGrammar:
        """Compiles a StructuredOutputsParams' constraint; ValueError saying why when the library refuses it."""


def without_additional_properties(schema):
    """The schema with `additionalProperties: false` on every object that does not say otherwise."""
    schema = copy.deepcopy(schema)

    def visit(node):
        if isinstance(node, dict):
            if node.get("type") == "object" or "properties" in node:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema


def legacy_structural_tag(spec: dict) -> tuple[list[dict], list[str]] | None:
    """vLLM's older structural tag, {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: its parts."""
    if isinstance(spec, dict) and "structures" in spec:
        structures = spec["structures"]
        triggers = spec.get("triggers", [])
        if not isinstance(structures, list) or not isinstance(triggers, list):
            raise ValueError("structural_tag: structures and triggers must be lists.")
        for s in structures:
            if not isinstance(s, dict) or not {"begin", "end"} <= set(s):
                raise ValueError("structural_tag: each structure needs begin, schema and end.")
        return structures, triggers
    return None
