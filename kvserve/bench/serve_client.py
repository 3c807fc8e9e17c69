"""One streamed request to any OpenAI-compatible server, timed chunk by chunk (httpx, SSE).

Only chunks that carry output text are timed: a role-only first chunk (some chat servers send it before
any token) or the empty closing chunk with finish_reason would otherwise shorten TTFT or add a fake ITL.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from kvserve.bench.metrics import RequestResult

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)


@dataclass
class RequestSpec:
    prompt: str | list[int]  # token ids only for /v1/completions (the OpenAI API accepts an id array)
    prompt_len: int
    output_len: int


def build_payload(endpoint: str, model: str, spec: RequestSpec, ignore_eos: bool) -> dict:
    payload = {"model": model, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == CHAT_COMPLETIONS:
        if not isinstance(spec.prompt, str):
            raise ValueError("chat completions need text prompts; decode token ids before sending.")
        payload["messages"] = [{"role": "user", "content": spec.prompt}]
        # Both names: newer servers read max_completion_tokens, older ones max_tokens.
        payload["max_completion_tokens"] = payload["max_tokens"] = spec.output_len
    else:
        payload["prompt"] = spec.prompt
        payload["max_tokens"] = spec.output_len
    if ignore_eos:
        # vLLM extensions that pin the output length; servers that do not know them ignore them.
        payload["ignore_eos"] = True
        payload["min_tokens"] = spec.output_len
    return payload


def _chunk_text(endpoint: str, choice: dict) -> str:
    if endpoint == CHAT_COMPLETIONS:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(client, url: str, endpoint: str, payload: dict, spec: RequestSpec,
                       bench_start: float, count_tokens=None, clock=time.perf_counter) -> RequestResult:
    """Streams one request with an httpx.AsyncClient. count_tokens(text) -> int is the fallback when the
    server sends no usage; without it every output chunk counts as one token. clock is injectable so the
    timing arithmetic can be tested on a scripted clock."""
    import httpx

    result = RequestResult(prompt_len=spec.prompt_len)
    texts: list[str] = []
    usage = None
    st = clock()
    result.start_time = st - bench_start
    last = st
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            async for line in response.aiter_lines():
                now = clock()
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, ": keep-alive" comments, event: lines
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"server error in stream: {json.dumps(chunk['error'])[:500]}"
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                text = _chunk_text(endpoint, choices[0]) if choices else ""
                if not text:
                    continue
                if not texts:
                    result.ttft = now - st
                else:
                    result.itl.append(now - last)
                last = now
                texts.append(text)
                result.chunk_times.append(now - bench_start)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if not texts:
        result.error = "Never received a chunk with output text, so TTFT is undefined."
        return result
    result.success = True
    result.latency = last - st
    result.generated_text = "".join(texts)
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
    elif count_tokens is not None:
        result.output_tokens = count_tokens(result.generated_text)
    else:
        result.output_tokens = len(texts)
    if usage and usage.get("prompt_tokens") is not None:
        result.prompt_len = int(usage["prompt_tokens"])
    return result
