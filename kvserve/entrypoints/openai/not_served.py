"""vLLM's endpoints that kvserve does not serve yet: they answer 404 with an OpenAI error that says so,
rather than a bare "Not Found" that reads like a wrong URL. (README lists them.)"""

from __future__ import annotations

# path -> what it is in vLLM
NOT_SERVED_YET = {
    "/v1/embeddings": "embeddings",
    "/v1/responses": "the Responses API",
    "/v1/score": "scoring",
    "/score": "scoring",
    "/v1/rerank": "reranking",
    "/rerank": "reranking",
    "/v2/rerank": "reranking",
    "/pooling": "pooling",
    "/classify": "classification",
    "/v1/classify": "classification",
    "/v1/load_lora_adapter": "LoRA adapters",
    "/v1/unload_lora_adapter": "LoRA adapters",
    "/v1/audio/transcriptions": "audio transcription",
    "/v1/audio/translations": "audio translation",
    "/v1/chat/completions/render": "prompt rendering",
    "/v1/completions/render": "prompt rendering",
    "/invocations": "SageMaker invocations",
    "/inference/v1/generate": "token-in, token-out generation",
    "/v1/realtime": "the Realtime API",
}
# Every path under these is vLLM's too.
NOT_SERVED_PREFIXES = {"/v1/audio/": "audio", "/v1/responses/": "the Responses API"}


def not_served_message(path: str) -> str | None:
    what = NOT_SERVED_YET.get(path.rstrip("/") or path)
    if what is None:
        what = next((w for prefix, w in NOT_SERVED_PREFIXES.items() if path.startswith(prefix)), None)
    if what is None:
        return None
    return (f"kvserve does not serve {path} ({what}, a vLLM endpoint) yet. It serves /v1/completions, "
            f"/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics and /version.")
