"""The model creator's sampling defaults (generation_config.json), as vLLM applies them.

`--generation-config auto` (the default) reads generation_config.json beside the model's config.json;
`vllm` ignores it (neutral defaults); any other value is a folder holding a generation_config.json.
`--override-generation-config '{"temperature": 0.5}'` is applied on top. Only the fields vLLM takes are
used, under SamplingParams' names (HF's max_new_tokens is our max_tokens); they fill in what a request
leaves unset, and never override what it sets.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERATION_CONFIG_FILE = "generation_config.json"
# HF name -> SamplingParams name, the fields vLLM takes from a generation config.
_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def default_sampling_fields(model_path: Path, source: str = "auto", override: str | dict | None = None) -> dict:
    """SamplingParams defaults from the model (or `source`), with `override` on top; {} when there are none."""
    if source == "vllm":
        raw = {}
    elif source == "auto":
        raw = _read(model_path / GENERATION_CONFIG_FILE) if model_path.is_dir() else {}
    else:
        folder = Path(source).expanduser()
        file = folder if folder.is_file() else folder / GENERATION_CONFIG_FILE
        if not file.is_file():
            raise ValueError(f"--generation-config {source!r}: no {GENERATION_CONFIG_FILE} there. "
                             f"Use auto (the model's), vllm (none), or a folder holding {GENERATION_CONFIG_FILE}.")
        raw = _read(file)
    raw = {**raw, **_parse_override(override)}
    return {ours: raw[hf] for hf, ours in _FIELDS.items() if raw.get(hf) is not None}


def describe(source: str, fields: dict) -> str:
    """The start-up log line (vLLM logs the same fact)."""
    origin = {"auto": "the model's generation_config.json", "vllm": "--override-generation-config"}.get(source, source)
    return (f"Default sampling parameters from {origin}: {fields}. Requests that leave these unset use them; "
            f"pass --generation-config vllm to ignore the model's.")


def _read(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}); fix it or pass --generation-config vllm.") from None
    return data if isinstance(data, dict) else {}


def _parse_override(override: str | dict | None) -> dict:
    if override is None or override == "":
        return {}
    if isinstance(override, dict):
        data = override
    else:
        try:
            data = json.loads(override)
        except json.JSONDecodeError as e:
            raise ValueError(f"--override-generation-config must be a JSON object, e.g. '{{\"temperature\": 0.5}}' "
                             f"({e}).") from None
    if not isinstance(data, dict):
        raise ValueError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'.")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config: {', '.join(unknown)} not understood; "
                         f"known fields: {', '.join(_FIELDS)}.")
    return data
