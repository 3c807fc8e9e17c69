"""What a prompt may be, and how it becomes (text, token ids): one rule for the engine and the server."""

from __future__ import annotations


def parse_prompt(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """A prompt is a string, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of ids; text is
    tokenized with `tokenizer` (None under skip_tokenizer_init, where only token ids are accepted)."""
    if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt):
        if tokenizer is None:
            raise ValueError("skip_tokenizer_init is set: give prompts as {'prompt_token_ids': [...]}.")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], tokenizer.encode(prompt["prompt"])
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise ValueError(
        "A prompt must be a string, {'prompt': str}, {'prompt_token_ids': [int, ...]} or a list of token ids; "
        f"got {type(prompt).__name__}."
    )
