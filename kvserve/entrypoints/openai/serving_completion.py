"""POST /v1/completions: one or many prompts (text or token ids), n samples each, streamed or not."""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from kvserve.entrypoints.openai.errors import APIError, sse_error
from kvserve.entrypoints.openai.protocol import CompletionRequest
from kvserve.entrypoints.openai.serving_base import (
    SSE_DONE,
    EventStreamResponse,
    RequestCounts,
    ServingBase,
    before_deadline,
    completion_logprobs,
    engine_error,
    merged,
    prompt_logprobs_json,
    sse,
    until_disconnect,
    usage,
)


class _Prompt:
    """One prompt of the request, and what each of its n choices has produced so far."""

    def __init__(self, text: str | None, token_ids: list[int]):
        self.text = text
        self.token_ids = token_ids
        self.started: set[int] = set()  # choices whose first chunk went out (echo goes there)
        self.texts: dict[int, str] = {}
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}
        self.finish: dict[int, tuple[str | None, object]] = {}
        self.prompt_logprobs = None
        self.counts = RequestCounts(num_prompt_tokens=len(token_ids))  # until the engine's first output

    def keep_prompt_logprobs(self, out) -> None:
        # They arrive once, with the first output of the request.
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs


class ServingCompletion(ServingBase):
    async def create(self, req: CompletionRequest, raw: Request):
        self.check_request(req)
        deadline = self.deadline(raw, req.stream)
        prompts = await self._prompts(req)
        request_id = f"cmpl-{req.request_id or uuid.uuid4().hex}"
        if deadline is not None:
            deadline.request_id = request_id
        items = []
        constraint = await self.constraint(req)
        for i, p in enumerate(prompts):
            max_tokens = self.max_tokens_for(len(p.token_ids), req.max_tokens)
            fields = req.sampling_fields(max_tokens, req.logprobs)
            if constraint is not None:
                fields["structured_outputs"] = constraint
            if req.echo and req.logprobs is not None and "prompt_logprobs" not in fields:
                fields["prompt_logprobs"] = req.logprobs
            params = self.sampling_params(fields)
            prompt = self.validated(p.text, p.token_ids, params)
            if p.text is None and self.tokenizer is not None and req.echo:  # ids known to be in the vocabulary
                p.text = await self.decode(p.token_ids)
                prompt = dataclasses.replace(prompt, text=p.text)
            items.append((f"{request_id}-{i}", prompt, params))
        streams = await self.add_requests(items, raw, deadline)
        created = int(time.time())
        if req.stream:
            return EventStreamResponse(self._stream(req, request_id, created, prompts, streams, deadline),
                                       lambda: self.abort_all(streams))
        await until_disconnect(raw, self._collect(req, prompts, streams), lambda: self.abort_all(streams), deadline)
        return JSONResponse(self._response(req, request_id, created, prompts))

    async def _prompts(self, req: CompletionRequest) -> list[_Prompt]:
        raw = req.prompt
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise APIError("prompt must not be empty.", 400, "prompt")
        prompts = []
        for p in raw:
            if isinstance(p, str):
                ids = await self.encode(p, req.add_special_tokens)
                text = p
            else:
                ids, text = list(p), None
            kept = self.truncate(ids, req.truncate_prompt_tokens)
            if len(kept) != len(ids):
                ids, text = kept, None  # the text no longer matches: echo decodes what is kept (once validated)
            prompts.append(_Prompt(text, ids))
        return prompts

    # ---- choices ---------------------------------------------------------------------------------
    def _choice_delta(self, req: CompletionRequest, p: _Prompt, c) -> tuple[str, dict | None]:
        """Text and logprobs of one delta; echo puts the prompt (and its logprobs) before the first."""
        text, token_ids, positions = c.text, list(c.token_ids), list(c.logprobs or [])
        offset = len(p.texts.get(c.index, ""))
        if req.echo and c.index in p.started:
            offset += len(p.text or "")
        if req.echo and c.index not in p.started:
            text = (p.text or "") + text
            if req.logprobs is not None and p.prompt_logprobs is not None:
                token_ids = p.token_ids + token_ids
                positions = list(p.prompt_logprobs) + positions
        p.started.add(c.index)
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(token_ids, positions, self.tokenizer, offset)
        return text, logprobs

    async def _collect(self, req: CompletionRequest, prompts: list[_Prompt], streams) -> None:
        try:
            async for i, out in merged(streams):
                p = prompts[i]
                p.keep_prompt_logprobs(out)
                p.counts = RequestCounts.of(out)
                for c in out.outputs:
                    p.texts[c.index] = p.texts.get(c.index, "") + c.text
                    p.tokens.setdefault(c.index, []).extend(c.token_ids)
                    p.logprobs.setdefault(c.index, []).extend(c.logprobs or [])
                    if c.finish_reason is not None:
                        p.finish[c.index] = (c.finish_reason, c.stop_reason)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None

    def _response(self, req: CompletionRequest, request_id: str, created: int, prompts: list[_Prompt]) -> dict:
        choices = []
        for i, p in enumerate(prompts):
            for k in range(req.n):
                text, ids, positions = p.texts.get(k, ""), p.tokens.get(k, []), p.logprobs.get(k, [])
                logprobs = None
                if req.echo:
                    text = (p.text or "") + text
                if req.logprobs is not None:
                    if req.echo and p.prompt_logprobs is not None:
                        ids, positions = p.token_ids + ids, list(p.prompt_logprobs) + positions
                    logprobs = completion_logprobs(ids, positions, self.tokenizer)
                reason, stop_reason = p.finish.get(k, (None, None))
                choice = {"index": i * req.n + k, "text": text, "logprobs": logprobs,
                          "finish_reason": reason, "stop_reason": stop_reason}
                if p.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(p.prompt_logprobs, self.tokenizer)
                choices.append(choice)
        return {"id": request_id, "object": "text_completion", "created": created, "model": self.served_model_name,
                "choices": choices,
                "usage": usage(RequestCounts.total(p.counts for p in prompts))}

    async def _stream(self, req: CompletionRequest, request_id: str, created: int, prompts: list[_Prompt], streams,
                      deadline=None):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        try:
            async for i, out in before_deadline(merged(streams), deadline):
                p = prompts[i]
                p.keep_prompt_logprobs(out)
                p.counts = RequestCounts.of(out)  # the request's counts so far
                for c in out.outputs:
                    if (not c.text and not c.token_ids and c.finish_reason is None
                            and not (req.echo and c.index not in p.started)):
                        continue  # nothing new (as vLLM: a step with tokens is a chunk, even with no text yet)
                    text, logprobs = self._choice_delta(req, p, c)
                    p.texts[c.index] = p.texts.get(c.index, "") + c.text
                    chunk = {"id": request_id, "object": "text_completion", "created": created,
                             "model": self.served_model_name,
                             "choices": [{"index": i * req.n + c.index, "text": text, "logprobs": logprobs,
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                    if continuous:
                        chunk["usage"] = usage(RequestCounts.total(q.counts for q in prompts))
                    yield sse(chunk)
            if include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.served_model_name, "choices": [],
                           "usage": usage(RequestCounts.total(q.counts for q in prompts))})
        except Exception as e:  # noqa: BLE001 - the status line is gone: report in the stream
            err = engine_error(e)
            yield sse_error(err.message, err.status)
        finally:
            self.abort_all(streams)  # a client that went away frees its KV blocks now
        yield SSE_DONE
