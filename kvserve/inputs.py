"""What a prompt may be, and how it becomes (text, token ids): one rule for the engine and the server."""

from __future__ import annotations

_FORMS = "a string, {'prompt': str}, {'prompt_token_ids': [int, ...]} or a list of token ids"


def _check_text(text, where: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{where} must be a string, got {type(text).__name__}.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where} must be valid Unicode text (no lone surrogates such as '\\ud800').") from None
    return text


def _check_token_ids(ids, where: str) -> list[int]:
    if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{where} must be a list of integer token ids, got {type(ids).__name__}.")
    ids = list(ids)
    for i, t in enumerate(ids):
        # bool is an int subclass, but True is not a token; numpy / torch integers are accepted as ints.
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ValueError(f"{where}[{i}] is {t!r} ({type(t).__name__}); token ids must be integers.")
    return [int(t) for t in ids]


def parse_prompt(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """A prompt is a string, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of ids; text is
    tokenized with `tokenizer` (None under skip_tokenizer_init, where only token ids are accepted)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            return (None if text is None else _check_text(text, "prompt['prompt']"),
                    _check_token_ids(prompt["prompt_token_ids"], "prompt['prompt_token_ids']"))
        if "prompt" not in prompt:
            raise ValueError(f"A prompt must be {_FORMS}; got a dict without either key.")
        prompt = _check_text(prompt["prompt"], "prompt['prompt']")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("skip_tokenizer_init is set: give prompts as {'prompt_token_ids': [...]}.")
        return _check_text(prompt, "The prompt"), tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        return None, _check_token_ids(prompt, "The prompt")
    raise ValueError(f"A prompt must be {_FORMS}; got {type(prompt).__name__}.")
