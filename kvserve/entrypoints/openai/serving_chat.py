"""POST /v1/chat/completions: messages through the tokenizer's chat template, n choices, streamed or not.

The template's text is tokenized with special tokens parsed, as the template means them; text that came
from a message (its content, name, ...) never becomes a special token: a user who writes "<|im_end|>"
gets those characters, not the end of their turn and the start of one they forged."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
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
    RequestCounts,
    ServingBase,
    before_deadline,
    chat_logprobs,
    engine_error,
    prompt_logprobs_json,
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


class _SpecialTokensAsText:
    """Marks where special-token strings from the messages end up in the rendered prompt. Each occurrence
    in a message string (any field but the role) is replaced, before rendering, by a placeholder that
    carries a per-request random nonce (so no client can write one); after rendering, each placeholder
    is put back and its span remembered, wherever the template placed (or trimmed around) the text."""

    def __init__(self, special: list[str]):
        self._pattern = re.compile("|".join(re.escape(t) for t in special)) if special else None
        self.nonce = secrets.token_hex(8)
        self.originals: list[str] = []

    def hide(self, conversation: list[dict]) -> list[dict]:
        if self._pattern is None:
            return conversation
        return [{k: self._hide(v) if k != "role" and isinstance(v, str) else v for k, v in m.items()}
                for m in conversation]

    def _hide(self, value: str) -> str:
        def placeholder(match):
            self.originals.append(match.group())
            return f"\ue000{self.nonce}:{len(self.originals) - 1}\ue001"
        return self._pattern.sub(placeholder, value)

    def restore(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text with the special tokens back, and the spans they cover in it."""
        if not self.originals:
            return text, []
        out, spans, cursor, seen = [], [], 0, 0
        length = 0
        for match in re.finditer("\ue000" + self.nonce + r":(\d+)\ue001", text):
            token = self.originals[int(match.group(1))]
            out.append(text[cursor:match.start()])
            length += match.start() - cursor
            spans.append((length, length + len(token)))
            out.append(token)
            length += len(token)
            cursor = match.end()
            seen += 1
        out.append(text[cursor:])
        restored = "".join(out)
        if seen != len(self.originals) or "\ue000" + self.nonce in restored:
            raise APIError(f"A message contains the special token {self.originals[0]!r}, and the chat template "
                           f"rewrites that message's text, so it cannot be kept as plain text; remove the token.",
                           400, "messages")
        return restored, spans


def _encode_keeping_spans_as_text(tokenizer, text: str, spans, add_special_tokens: bool) -> list[int]:
    """Tokenizes `text` with special tokens parsed, except inside `spans`, tokenized as plain text. The
    tokenizer splits at special tokens anyway, so the rest tokenizes exactly as the whole text would."""
    pieces, cursor = [], 0
    for a, b in spans:
        if a > cursor:
            pieces.append((text[cursor:a], False))
        pieces.append((text[a:b], True))
        cursor = b
    if cursor < len(text):
        pieces.append((text[cursor:], False))
    ids: list[int] = []
    for i, (piece, as_text) in enumerate(pieces):
        ids += tokenizer.encode(piece, add_special_tokens=add_special_tokens and i == 0,
                                split_special_tokens=as_text)
    return ids


class ServingChat(ServingBase):
    def __init__(self, *args, trust_request_chat_template: bool = False, tool_call_parser: str | None = None,
                 **kwargs):
        limits = {k: kwargs.pop(k) for k in ("timeout_s", "max_output_chars", "num_workers") if k in kwargs}
        super().__init__(*args, **kwargs)
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_call_parser = tool_call_parser  # tool_choice "auto" is refused without one
        self.renderer: ChatTemplateRenderer | None = None  # started once the tokenizer is loaded
        self._renderer_lock = threading.Lock()
        self._renderer_limits = limits  # ChatTemplateRenderer's time and size limits
        self._renderer_failed = False
        self._special_strings: list[str] | None = None

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

    def special_strings(self) -> list[str]:
        """The tokenizer's special tokens as text, longest first."""
        if self._special_strings is None:
            tokenizer = self.tokenizer
            try:
                found = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
            except AttributeError:  # not a transformers tokenizer: its declared special tokens
                found = set(getattr(tokenizer, "all_special_tokens", ()))
            self._special_strings = sorted((s for s in found if s), key=len, reverse=True)
        return self._special_strings

    async def render_and_encode(self, messages: list[ChatMessage], add_generation_prompt: bool,
                                continue_final_message: bool, chat_template: str | None,
                                chat_template_kwargs: dict | None, add_special_tokens: bool,
                                tools: list | None = None) -> tuple[str, list[int]]:
        """The prompt text of `messages` and its token ids, special tokens from the messages kept as text."""
        marks = _SpecialTokensAsText(self.special_strings())
        conversation = marks.hide([_message_dict(m) for m in messages])
        text, spans = marks.restore(await self._render(conversation, add_generation_prompt, continue_final_message,
                                                       chat_template, chat_template_kwargs, tools))
        if not spans:
            return text, await self.encode(text, add_special_tokens, "messages")
        tokenizer = self.check_text_size(text, "messages")
        return text, await self.off_loop(_encode_keeping_spans_as_text, tokenizer, text, spans, add_special_tokens)

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          continue_final_message: bool, chat_template: str | None,
                          chat_template_kwargs: dict | None, tools: list | None = None) -> str:
        return await self._render([_message_dict(m) for m in messages], add_generation_prompt,
                                  continue_final_message, chat_template, chat_template_kwargs, tools)

    async def _render(self, conversation: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                      chat_template: str | None, chat_template_kwargs: dict | None, tools: list | None = None) -> str:
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
        deadline = self.deadline(raw, req.stream)
        text, token_ids = await self.render_and_encode(
            req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template,
            req.chat_template_kwargs, req.add_special_tokens, req.tools)
        kept = self.truncate(token_ids, req.truncate_prompt_tokens)
        if len(kept) != len(token_ids):
            token_ids, text = kept, None  # the text no longer matches the ids
        max_tokens = self.max_tokens_for(len(token_ids), req.requested_max_tokens)
        fields = req.sampling_fields(max_tokens, req.num_logprobs)
        if constraint is not None:
            fields["structured_outputs"] = constraint
        renamed = {"logprobs": "top_logprobs"}
        params = self.sampling_params(fields, renamed)
        prompt = self.validated(text, token_ids, params, renamed)
        reader = self.output_reader(plan, token_ids)
        request_id = f"chatcmpl-{req.request_id or uuid.uuid4().hex}"
        if deadline is not None:
            deadline.request_id = request_id
        streams = await self.add_requests([(request_id, prompt, params)], raw, deadline)
        created = int(time.time())
        echo = self._echo(req)
        if req.stream:
            return EventStreamResponse(self._stream(req, request_id, created, len(token_ids), streams[0], reader,
                                                    echo, deadline), lambda: self.abort_all(streams))
        result = await until_disconnect(raw, self._collect(req, streams[0]), lambda: self.abort_all(streams),
                                        deadline)
        return JSONResponse(self._response(req, request_id, created, reader, *result, echo=echo))

    def _echo(self, req: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's content, when that message has the reply's role."""
        if not req.echo:
            return ""
        role = self.response_role if req.add_generation_prompt else req.messages[-1].role
        last = req.messages[-1]
        return _message_dict(last)["content"] if last.role == role else ""

    async def _collect(self, req: ChatCompletionRequest, stream):
        texts: dict[int, str] = {}
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list] = {}
        finish: dict[int, tuple] = {}
        counts = RequestCounts()
        prompt_logprobs = None
        try:
            async for out in stream:
                counts = RequestCounts.of(out)
                if prompt_logprobs is None:
                    prompt_logprobs = out.prompt_logprobs
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
        return texts, tokens, logprobs, finish, counts, prompt_logprobs

    def _response(self, req, request_id, created, reader, texts, tokens, logprobs, finish,
                  counts: RequestCounts | None = None, prompt_logprobs=None, echo: str = "") -> dict:
        choices = []
        for k in range(req.n):
            ids = tokens.get(k, [])
            lp = None
            if req.logprobs:
                lp = {"content": chat_logprobs(ids, logprobs.get(k, []), req.top_logprobs or 0, self.tokenizer),
                      "refusal": None}
            reason, stop_reason = finish.get(k, (None, None))
            message, reason = reader.message(texts.get(k, ""), reason)
            choices.append({
                "index": k,
                "message": {"role": self.response_role, "refusal": None,
                            **{**message, "content": echo + message["content"] if echo else message["content"]}},
                "logprobs": lp,
                "finish_reason": reason,
                "stop_reason": stop_reason,
            })
        response = {"id": request_id, "object": "chat.completion", "created": created,
                    "model": self.served_model_name, "choices": choices,
                    "usage": usage(counts)}
        if prompt_logprobs is not None:  # vLLM's field, beside choices
            response["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs, self.tokenizer)
        return response

    async def _stream(self, req: ChatCompletionRequest, request_id: str, created: int, num_prompt: int, stream,
                      reader: ChatOutputReader, echo: str = "", deadline=None):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.served_model_name}
        counts = RequestCounts(num_prompt_tokens=num_prompt)  # until the engine's first output
        choice_streams = [reader.streamer() for _ in range(req.n)]
        try:
            # OpenAI opens every choice with a chunk that carries only the role.
            for k in range(req.n):
                first = {**base, "choices": [{"index": k, "delta": {"role": self.response_role, "content": ""},
                                              "logprobs": None, "finish_reason": None}]}
                if continuous:
                    first["usage"] = usage(counts)
                yield sse(first)
            if echo:
                for k in range(req.n):
                    yield sse({**base, "choices": [{"index": k, "delta": {"content": echo}, "logprobs": None,
                                                    "finish_reason": None}]})
            async for out in before_deadline(stream, deadline):
                counts = RequestCounts.of(out)  # the request's counts so far
                for c in out.outputs:
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
                            chunk["usage"] = usage(counts)
                        yield sse(chunk)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(counts)})
        except Exception as e:  # noqa: BLE001 - the status line is gone: report in the stream
            err = engine_error(e)
            yield sse_error(err.message, err.status)
        finally:
            self.engine.abort(stream.request_id)  # a client that went away frees its KV blocks now
        yield SSE_DONE
