"""What happens to each request field that kvserve does not simply apply: refused (400, naming the field
and what to use), or accepted with one log line because it only tunes vLLM's internals. A field nobody
knows is logged too (once per name), so a misspelt `max_token` does not go unnoticed.

The fields the request models declare (protocol.py) are applied; these tables list the rest."""

from __future__ import annotations

import logging

from kvserve.entrypoints.openai.errors import APIError

logger = logging.getLogger("kvserve.server")


def _given(value, body: dict) -> bool:
    return value is not None


# Asking for what is not built yet is a 400, never free text. field -> (what it asks for, whether this
# value, in this body, asks for it).
NOT_SUPPORTED_YET = {
    # vLLM's top-level structural_tag field (structured_outputs.structural_tag and response_format's work).
    "structural_tag": ("structured outputs (a top-level structural tag; send it in structured_outputs)", _given),
}

# Refused whatever the endpoint: field -> (the value that asks for nothing, what to do instead).
REFUSED = {
    "prompt_embeds": (None, "prompt_embeds is not supported: send the prompt as text or token ids."),
    "logprob_token_ids": (None, "logprob_token_ids is not supported: use logprobs (the top tokens)."),
    "return_tokens_as_token_ids": (None, "return_tokens_as_token_ids is not supported yet; leave it unset."),
    "return_token_ids": (None, "return_token_ids is not supported yet: POST /tokenize gives a text's token ids."),
    "truncation_side": ("left", ("truncation_side: only 'left' (keep the last truncate_prompt_tokens tokens) "
                                 "is supported.")),
    "cache_salt": (None, "cache_salt is not supported yet: the prefix cache is shared by every request."),
    "priority": (0, ("priority is not supported: kvserve schedules first come, first served (vLLM also refuses "
                     "it without --scheduling-policy priority).")),
    "logits_processors": (None, "logits_processors is not supported."),
    "watermarking": (None, "watermarking is not supported."),
    "repetition_detection": (None, "repetition_detection is not supported yet; use max_tokens or stop."),
    "thinking_token_budget": (None, "thinking_token_budget is not supported yet; use max_tokens."),
    "documents": (None, "documents is not supported yet: put the documents into the messages."),
    "functions": (None, "functions (and tools) are not supported yet: tool calling is not built."),
    "function_call": (None, "function_call (and tool_choice) are not supported yet: tool calling is not built."),
    "audio": (None, "audio output is not supported."),
    "web_search_options": (None, "web search is not supported."),
}

# Accepted, with no effect here (vLLM's internal tuning, disaggregated serving, OpenAI bookkeeping).
NO_EFFECT = frozenset({
    "user", "store", "metadata", "service_tier", "prediction", "modalities", "parallel_tool_calls",
    "reasoning_effort", "include_reasoning", "verbosity", "length_penalty", "stream_interval", "session_id",
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "mm_processor_kwargs", "return_token_offsets",
    "return_mm_kwargs", "routed_experts_prompt_start", "disable_log_requests",
})

_MAX_LOGGED_NAMES = 256
_logged: set[str] = set()


def check_fields(req) -> None:
    """Refuses (APIError 400) the first field of `req` that asks for what kvserve does not do; logs, once
    per name, the fields it accepts without effect and those it does not know."""
    declared = type(req).model_fields
    values = dict(req.model_extra or {})
    values.update((name, getattr(req, name)) for name in req.model_fields_set)
    for name, value in values.items():
        unsupported = NOT_SUPPORTED_YET.get(name)
        if unsupported is not None:
            what, asks = unsupported
            if asks(value, values):
                raise APIError(f"{name} is not supported yet: {what} is not built in kvserve. Remove the field "
                               f"to get unconstrained text.", 400, name)
            continue
        refused = REFUSED.get(name)
        if refused is not None:
            harmless, message = refused
            if value is not None and value != harmless:
                raise APIError(message, 400, name)
            continue
        if name in NO_EFFECT and value not in (None, False):
            _log_once(name, "Request field %r is accepted but has no effect in kvserve (logged once).")
        elif name not in declared:
            _log_once(name, "Unknown request field %r ignored (logged once per name).")


def _log_once(name: str, message: str) -> None:
    if name in _logged or len(_logged) >= _MAX_LOGGED_NAMES:
        return
    _logged.add(name)
    logger.warning(message, name[:100])
