"""StructuredOutputsParams: what a request's output must match (vLLM's class and field names).

Pure Python (no grammar library, no torch): SamplingParams holds one, and it pickles to the engine and
the workers as it is. Exactly one constraint is set; `key()` is what the compile cache is keyed by.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.request_limits import check_spec_size

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (text or object)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark
    json_object: bool | None = None  # any JSON object
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON text
    disable_fallback: bool = False  # auto: do not fall back to llguidance where xgrammar refuses
    disable_any_whitespace: bool = False  # JSON without optional whitespace
    disable_additional_properties: bool = False  # JSON objects carry only the schema's properties
    whitespace_pattern: str | None = None  # accepted for vLLM compatibility; refused when set

    def __post_init__(self):
        if isinstance(self.json, (bytes, bytearray)):
            self.json = self.json.decode()
        set_fields = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(CONSTRAINTS)}; got "
                f"{', '.join(set_fields) if set_fields else 'none'}.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported; use disable_any_whitespace.")
        kind = set_fields[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object).")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            self.choice = list(value)
        elif kind == "json_object":
            if value is not True:
                raise ValueError("structured_outputs.json_object must be true.")
        elif not isinstance(value, str) or not value.strip():
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string.")
        check_spec_size(f"structured_outputs.{kind}", self.spec)

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (a schema canonically serialized, so equal schemas share a cache entry)."""
        kind = self.kind
        if kind == "json":
            return json.dumps(self.json, sort_keys=True, ensure_ascii=False)
        if kind == "choice":
            return json.dumps(self.choice, ensure_ascii=False)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    def key(self) -> tuple:
        return (self.kind, self.spec, self.disable_any_whitespace, self.disable_additional_properties,
                self.disable_fallback)

    @classmethod
    def from_dict(cls, data) -> StructuredOutputsParams:
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(data).__name__}.")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s): {', '.join(sorted(unknown))}.")
        return cls(**{k: v for k, v in data.items()})
