"""POST /v1/chat/completions: messages through the tokenizer's chat template, n choices, streamed or not."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

import json

from kvserve.entrypoints.openai.chat_output import ChatOutputReader
from kvserve.entrypoints.openai.chat_renderer import ChatTemplateRenderer
from kvserve.entrypoints.openai.errors import APIError, sse_error
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from kvserve.entrypoints.openai.serving_base import (
    SSE_DONE,
    EventStreamResponse,
    ServingBase,
    chat_logprobs,
    engine_error,
    sse,
    until_disconnect,
    usage,
)
from kvserve.entrypoints.openai.structured_request import tool_plan
from kvserve.entrypoints.openai.tool_parsers import get_tool_parser
from kvserve.structured_output.reasoning import END, START, get_reasoning_parser, thinking_ended_in

logger = logging.getLogger(__name__)


def _message_dict(m: ChatMessage) -> dict:
    """Text-only content: a list of content parts is joined into one string (images etc. are refused)."""
    d = m.model_dump(exclude_none=True)
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise APIError(f"Content parts of type {str(part.get('type'))[:40]!r} are not supported; only text.",
                               400, "messages")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise APIError("The text of a content part must be a string.", 400, "messages")
            texts.append(text)
        d["content"] = "\n".join(texts)
    elif content is None:
        d["content"] = ""
    # Templates iterate over a call's arguments: give them the object, not its JSON text (as vLLM does).
    for call in d.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
    return d


class ServingChat(ServingBase):
    def __init__(self, *args, trust_request_chat_template: bool = False, tool_call_parser: str | None = None,
                 **kwargs):
        limits = {k: kwargs.pop(k) for k in ("timeout_s", "max_output_chars") if k in kwargs}
        super().__init__(*args, **kwargs)
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_call_parser = tool_call_parser  # tool_choice "auto" is refused without one
        self.renderer: ChatTemplateRenderer | None = None  # started once the tokenizer is loaded
        self._renderer_lock = threading.Lock()
        self._renderer_limits = limits  # ChatTemplateRenderer's time and size limits
        self._renderer_failed = False

    def start_renderer(self) -> None:
        """Starts the render worker (the server calls this once the tokenizer is loaded, off the loop)."""
        with self._renderer_lock:
            if self.tokenizer is not None and self._grammar_compiler is None:
                self.grammar_compiler().warm_up()  # the grammar libraries load while the first requests come
            if self.tokenizer is not None and self.renderer is None and not self._renderer_failed:
                try:
                    self.renderer = ChatTemplateRenderer(self.tokenizer, **self._renderer_limits)
                except Exception:  # e.g. a tokenizer that cannot be pickled: render on a thread instead
                    logger.exception("Could not start the chat template worker; templates render on a thread, "
                                     "without a time limit.")
                    self._renderer_failed = True

    def close(self) -> None:
        if self.renderer is not None:
            self.renderer.close()

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          continue_final_message: bool, chat_template: str | None,
                          chat_template_kwargs: dict | None, tools: list | None = None) -> str:
        tokenizer = self.require_tokenizer("Chat")
        if chat_template is not None and not self.trust_request_chat_template:
            raise APIError("A chat_template in the request is refused: the server runs without "
                           "--trust-request-chat-template.", 400, "chat_template")
        template = chat_template or self.chat_template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise APIError("This model's tokenizer has no chat template; start the server with --chat-template.", 400)
        kwargs = dict(chat_template_kwargs or {})
        for name in ("tokenize", "chat_template", "add_generation_prompt", "continue_final_message", "return_dict",
                     "tools"):
            if name in kwargs:
                raise APIError(f"chat_template_kwargs may not set {name}.", 400, "chat_template_kwargs")
        kwargs.update(chat_template=template, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message)
        if tools:
            kwargs["tools"] = tools
        conversation = [_message_dict(m) for m in messages]
        if self.renderer is None:  # a request that beat the start-up hook
            await asyncio.get_running_loop().run_in_executor(None, self.start_renderer)
        try:
            if self.renderer is None:
                return await asyncio.get_running_loop().run_in_executor(
                    None, lambda: tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs))
            return await self.renderer.render(conversation, **kwargs)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - a template refusing the messages is the client's error
            raise APIError(f"The chat template could not render these messages: {e}", 400, "messages") from None

    def output_reader(self, plan, prompt_token_ids: list[int]) -> ChatOutputReader:
        parser = get_tool_parser(self.tool_call_parser) if plan.mode == "auto" else None
        reasoning = get_reasoning_parser(getattr(self.engine.config.args, "reasoning_parser", None))
        if reasoning is not None:
            tok = self.tokenizer
            start, end = (tok.encode(m, add_special_tokens=False) for m in (START, END))
            if thinking_ended_in(prompt_token_ids, start, end):  # e.g. thinking turned off: all answer
                reasoning = None
        return ChatOutputReader(plan, parser, reasoning)

    async def create(self, req: ChatCompletionRequest, raw: Request):
        self.check_request(req)
        try:
            plan = tool_plan(req.tools, req.tool_choice, self.tool_call_parser is not None)
        except ValueError as e:
            raise APIError(str(e), 400, "tool_choice" if str(e).startswith("tool_choice") else "tools") from None
        constraint = await self.constraint(req, plan, self.tool_call_parser)
        text = await self.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                                      req.chat_template, req.chat_template_kwargs, req.tools)
        token_ids = await self.encode(text, req.add_special_tokens, "messages")
        max_tokens = self.max_tokens_for(len(token_ids), req.requested_max_tokens)
        fields = req.sampling_fields(max_tokens, req.num_logprobs)
        if constraint is not None:
            fields["structured_outputs"] = constraint
        params = self.sampling_params(fields, {"logprobs": "top_logprobs"})
        reader = self.output_reader(plan, token_ids)
        request_id = f"chatcmpl-{req.request_id or uuid.uuid4().hex}"
        streams = await self.add_requests([(request_id, {"prompt": text, "prompt_token_ids": token_ids}, params)], raw)
        created = int(time.time())
        if req.stream:
            return EventStreamResponse(self._stream(req, request_id, created, len(token_ids), streams[0], reader),
                                       lambda: self.abort_all(streams))
        result = await until_disconnect(raw, self._collect(req, streams[0]), lambda: self.abort_all(streams))
        return JSONResponse(self._response(req, request_id, created, len(token_ids), reader, *result))

    async def _collect(self, req: ChatCompletionRequest, stream):
        texts: dict[int, str] = {}
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list] = {}
        finish: dict[int, tuple] = {}
        num_preemptions = 0
        try:
            async for out in stream:
                num_preemptions = getattr(out, "num_preemptions", 0)
                for c in out.outputs:
                    texts[c.index] = texts.get(c.index, "") + c.text
                    tokens.setdefault(c.index, []).extend(c.token_ids)
                    logprobs.setdefault(c.index, []).extend(c.logprobs or [])
                    if c.finish_reason is not None:
                        finish[c.index] = (c.finish_reason, c.stop_reason)
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None
        finally:
            self.engine.abort(stream.request_id)
        return texts, tokens, logprobs, finish, num_preemptions

    def _response(self, req, request_id, created, num_prompt, reader, texts, tokens, logprobs, finish,
                  num_preemptions: int = 0) -> dict:
        choices = []
        num_completion = 0
        for k in range(req.n):
            ids = tokens.get(k, [])
            num_completion += len(ids)
            lp = None
            if req.logprobs:
                lp = {"content": chat_logprobs(ids, logprobs.get(k, []), req.top_logprobs or 0, self.tokenizer),
                      "refusal": None}
            reason, stop_reason = finish.get(k, (None, None))
            message, reason = reader.message(texts.get(k, ""), reason)
            choices.append({
                "index": k,
                "message": {"role": self.response_role, "refusal": None, **message},
                "logprobs": lp,
                "finish_reason": reason,
                "stop_reason": stop_reason,
            })
        return {"id": request_id, "object": "chat.completion", "created": created, "model": self.served_model_name,
                "choices": choices, "usage": usage(num_prompt, num_completion, num_preemptions)}

    async def _stream(self, req: ChatCompletionRequest, request_id: str, created: int, num_prompt: int, stream,
                      reader: ChatOutputReader):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.served_model_name}
        num_completion = num_preemptions = 0
        choice_streams = [reader.streamer() for _ in range(req.n)]
        try:
            # OpenAI opens every choice with a chunk that carries only the role.
            for k in range(req.n):
                first = {**base, "choices": [{"index": k, "delta": {"role": self.response_role, "content": ""},
                                              "logprobs": None, "finish_reason": None}]}
                if continuous:
                    first["usage"] = usage(num_prompt, 0)
                yield sse(first)
            async for out in stream:
                num_preemptions = getattr(out, "num_preemptions", 0)  # the request's count so far
                for c in out.outputs:
                    num_completion += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue  # nothing new (as vLLM: a step with tokens is a chunk, even with no text yet)
                    lp = None
                    if req.logprobs:
                        lp = {"content": chat_logprobs(list(c.token_ids), list(c.logprobs or []),
                                                       req.top_logprobs or 0, self.tokenizer), "refusal": None}
                    deltas, finish_reason = choice_streams[c.index].feed(c.text, c.finish_reason)
                    # Every piece of the message is a chunk of its own; the last carries finish_reason.
                    deltas = deltas or [{}]
                    for j, delta in enumerate(deltas):
                        last = j == len(deltas) - 1
                        chunk = {**base, "choices": [{
                            "index": c.index, "delta": delta, "logprobs": lp if j == 0 else None,
                            "finish_reason": finish_reason if last else None,
                            "stop_reason": c.stop_reason if last else None}]}
                        if continuous:
                            chunk["usage"] = usage(num_prompt, num_completion, num_preemptions)
                        yield sse(chunk)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(num_prompt, num_completion, num_preemptions)})
        except Exception as e:  # noqa: BLE001 - the status line is gone: report in the stream
            err = engine_error(e)
            yield sse_error(err.message, err.status)
        finally:
            self.engine.abort(stream.request_id)  # a client that went away frees its KV blocks now
        yield SSE_DONE
