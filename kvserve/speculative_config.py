"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's JSON keys, parsed and checked once.

Pure Python (the API process and `kvserve plan` read it without torch). Every refusal names the key and
what to do instead; keys vLLM has and kvserve does not are refused rather than ignored, since they would
change what a vLLM user expects to run.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "eagle3")
# The methods the engine runs today; the others parse and are refused in one place (`check_runnable`).
RUNNABLE_METHODS: tuple[str, ...] = ("ngram", "draft_model", "eagle3")

_KNOWN_ELSEWHERE = {  # vLLM methods kvserve does not have, with what to use instead
    "eagle": "EAGLE-1 heads are not supported; use an EAGLE-3 head with \"method\": \"eagle3\"",
    "medusa": "Medusa heads are not supported; use \"eagle3\", \"draft_model\" or \"ngram\"",
    "mlp_speculator": "MLP speculators are not supported; use \"eagle3\", \"draft_model\" or \"ngram\"",
    "suffix": "suffix decoding is not supported; \"ngram\" (prompt lookup) is the closest",
    "ngram_gpu": "use \"ngram\": kvserve's prompt lookup runs on the host without stalling the step",
    "mtp": "multi-token-prediction heads belong to MoE models, which kvserve does not serve",
}
_UNSUPPORTED_KEYS = {  # vLLM keys that would change behaviour, refused with a reason
    "quantization": "a quantized draft is not supported; the draft loads unquantized",
    "kv_cache_dtype": "the draft's KV cache takes the target's --kv-cache-dtype",
    "max_model_len": "the draft runs to the target's --max-model-len",
    "revision": "give the draft as a local directory or a repo id at its default revision",
    "code_revision": "kvserve runs no code from model repositories",
    "speculative_token_tree": "tree drafts are not supported; drafts are one chain per request",
    "parallel_drafting": "parallel drafting is not supported; drafts are chained",
    "use_heterogeneous_vocab": "the draft must share the target's tokenizer",
    "num_speculative_tokens_per_batch_size": "kvserve sizes drafts per step from batch size and measured "
                                             "acceptance on its own",
    "attention_backend": "the draft uses the target's --attention-backend",
    "moe_backend": "kvserve's models are dense",
}
_ACCEPTED_NEUTRAL = {  # vLLM keys accepted only at the value that is what kvserve does
    "rejection_sample_method": ("standard",),
    "disable_padded_drafter_batch": (False,),
    "enforce_eager": (None, False),
    "tensor_parallel_size": (None,),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft model or EAGLE-3 head (draft_model, eagle3)
    prompt_lookup_min: int | None = None  # ngram
    prompt_lookup_max: int | None = None  # ngram
    draft_tensor_parallel_size: int | None = None  # None or the target's: the draft shards like the target
    draft_sample_method: str = "greedy"  # greedy: one-hot drafts; probabilistic: drafts carry their probs

    @property
    def uses_draft_weights(self) -> bool:
        return self.method in ("draft_model", "eagle3")


def _bad(msg: str):
    raise ValueError(f"--speculative-config: {msg}")


def _positive_int(cfg: dict, key: str, required: bool = False) -> int | None:
    value = cfg.get(key)
    if value is None:
        if required:
            _bad(f"\"{key}\" is required, e.g. {{\"{key}\": 3}}.")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _bad(f"\"{key}\" must be an integer >= 1, got {value!r}.")
    return value


def _method_of(cfg: dict) -> str:
    method, model = cfg.get("method"), cfg.get("model")
    if method is None and model is not None:
        # vLLM's rule: the method follows from the model's name when not given.
        name = str(model).lower()
        method = "ngram" if name in ("ngram", "[ngram]") else "eagle3" if "eagle3" in name else (
            "eagle" if "eagle" in name else "draft_model")
    if method == "[ngram]":
        method = "ngram"
    if method is None:
        _bad(f"\"method\" is required: one of {', '.join(METHODS)}.")
    if method in _KNOWN_ELSEWHERE:
        _bad(f"method {method!r}: {_KNOWN_ELSEWHERE[method]}.")
    if method not in METHODS:
        _bad(f"method {method!r} is not one of {', '.join(METHODS)}.")
    return method


def parse_speculative_config(value: str | dict | None, target_tensor_parallel_size: int = 1
                             ) -> SpeculativeConfig | None:
    """A JSON string (the CLI) or a dict (`LLM(...)`) -> SpeculativeConfig; None/empty: no speculation."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, SpeculativeConfig):  # parsed before: checked again against this target
        value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            _bad(f"not valid JSON ({e.msg} at character {e.pos}); e.g. "
                 "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}'.")
    if not isinstance(value, dict):
        _bad(f"must be a JSON object, got {type(value).__name__}.")
    cfg = dict(value)
    known = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
             "draft_tensor_parallel_size", "draft_sample_method"}
    for key in cfg:
        if key in _UNSUPPORTED_KEYS:
            _bad(f"\"{key}\" is not supported: {_UNSUPPORTED_KEYS[key]}.")
        if key in _ACCEPTED_NEUTRAL:
            if cfg[key] not in _ACCEPTED_NEUTRAL[key]:
                hint = " (use \"draft_tensor_parallel_size\")" if key == "tensor_parallel_size" else ""
                _bad(f"\"{key}\" = {cfg[key]!r} is not supported; only {_ACCEPTED_NEUTRAL[key][0]!r}{hint}.")
            continue
        if key not in known:
            _bad(f"unknown key \"{key}\"; kvserve reads {', '.join(sorted(known))}.")
    method = _method_of(cfg)
    k = _positive_int(cfg, "num_speculative_tokens", required=True)
    model = cfg.get("model")
    lookup_min, lookup_max = _positive_int(cfg, "prompt_lookup_min"), _positive_int(cfg, "prompt_lookup_max")
    if method == "ngram":
        if model not in (None, "ngram", "[ngram]"):
            _bad("method ngram takes no \"model\": its drafts come from the request's own tokens.")
        model = None
        # vLLM's defaults: 5 and 5 when neither is given, else the one given for both.
        lookup_min = lookup_min or lookup_max or 5
        lookup_max = lookup_max or lookup_min
        if lookup_min > lookup_max:
            _bad(f"prompt_lookup_min ({lookup_min}) must be <= prompt_lookup_max ({lookup_max}).")
    else:
        if not isinstance(model, str) or not model:
            _bad(f"method {method} needs \"model\": the {'EAGLE-3 head' if method == 'eagle3' else 'draft model'}"
                 f" (a local directory or a Hugging Face repo id).")
        if lookup_min is not None or lookup_max is not None:
            _bad("prompt_lookup_min / prompt_lookup_max apply to method ngram only.")
    draft_tp = _positive_int(cfg, "draft_tensor_parallel_size")
    if draft_tp is not None:
        if method == "ngram":
            _bad("draft_tensor_parallel_size applies to a draft model; method ngram has none.")
        if draft_tp != target_tensor_parallel_size:
            _bad(f"draft_tensor_parallel_size {draft_tp} must equal --tensor-parallel-size "
                 f"{target_tensor_parallel_size}: the draft is sharded like the target.")
    sample_method = cfg.get("draft_sample_method", "greedy")
    if sample_method not in ("greedy", "probabilistic"):
        _bad(f"draft_sample_method {sample_method!r} is not one of greedy, probabilistic.")
    if sample_method == "probabilistic" and method == "ngram":
        _bad("draft_sample_method probabilistic needs a draft model; ngram drafts are deterministic.")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, model=model, prompt_lookup_min=lookup_min,
                             prompt_lookup_max=lookup_max, draft_tensor_parallel_size=draft_tp,
                             draft_sample_method=sample_method)


def check_runnable(spec: SpeculativeConfig | None) -> None:
    """The one place that says which parsed methods the engine can run."""
    if spec is not None and spec.method not in RUNNABLE_METHODS:
        _bad(f"method {spec.method} is not supported yet; remove the flag.")
