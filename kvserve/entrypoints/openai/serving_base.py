"""What /v1/completions and /v1/chat/completions share: model check, context-length check, SamplingParams
from a request, logprob formatting, usage, disconnect handling and SSE framing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvserve.engine.async_engine import AsyncEngine, EngineFailedError, EngineNotReadyError
from kvserve.entrypoints.openai.errors import APIError
from kvserve.entrypoints.openai.structured_request import request_constraint
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output.compiler import GrammarCompiler, StructuredOutputsConfig
from kvserve.structured_output.limits import COMPILE_TIMEOUT_S
from kvserve.structured_output.params import StructuredOutputsParams

_SAMPLING_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp to this


# Tokenizing and detokenizing long texts runs here, off the event loop (the Rust tokenizer releases the GIL).
_TEXT_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvserve-tokenize")


class ServingBase:
    def __init__(self, engine: AsyncEngine, served_model_name: str, response_role: str = "assistant",
                 chat_template: str | None = None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.response_role = response_role
        self.chat_template = chat_template
        self._max_token_bytes: int | None = None
        self._grammar_compiler: GrammarCompiler | None = None

    # ---- text work, off the event loop -----------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Token ids of `text`, tokenized on a worker thread. A text so long that it cannot fit the context
        whatever its tokens (each token covers at most the vocabulary's longest token in bytes) is refused
        before it costs any tokenizer time."""
        tokenizer = self.require_tokenizer("A text prompt")
        num_bytes = len(text.encode("utf-8"))
        longest = self._longest_token_bytes(tokenizer)
        if num_bytes > self.max_model_len * longest:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens; the text has {num_bytes} "
                f"bytes, more than that many tokens can hold. Please shorten it.", 400, param)
        return await asyncio.get_running_loop().run_in_executor(
            _TEXT_POOL, lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def decode(self, token_ids: list[int]) -> str:
        tokenizer = self.require_tokenizer("Detokenizing")
        return await asyncio.get_running_loop().run_in_executor(_TEXT_POOL, tokenizer.decode, token_ids)

    def _longest_token_bytes(self, tokenizer) -> int:
        if self._max_token_bytes is None:
            try:
                self._max_token_bytes = max(len(t.encode("utf-8")) for t in tokenizer.get_vocab()) + 8
            except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary listing: no early refusal
                self._max_token_bytes = 1 << 30
        return self._max_token_bytes

    # ---- checks ----------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(f"The model `{model}` does not exist.", 404, "model")

    def check_request(self, req) -> None:
        """The model exists (404) and the body's cross-field rules hold (400)."""
        self.check_model(req.model)
        try:
            req.check()
        except ValueError as e:
            raise APIError(str(e), 400, _param_of(str(e))) from None

    def require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise APIError(f"{what} needs a tokenizer, and the server runs with --skip-tokenizer-init.", 400)
        return self.tokenizer

    def max_tokens_for(self, num_prompt: int, max_tokens: int | None) -> int:
        """vLLM's context check and messages; an unset max_tokens takes what is left of the context."""
        limit = self.max_model_len
        if max_tokens is None:
            if num_prompt >= limit:
                raise APIError(
                    f"This model's maximum context length is {limit} tokens. However, your request has "
                    f"{num_prompt} input tokens. Please reduce the length of the input messages.", 400, "messages")
            # The generation config's max_new_tokens caps an unset max_tokens (vLLM's get_max_tokens).
            return min(limit - num_prompt, self.default_sampling.get("max_tokens") or limit)
        if max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {max_tokens}.", 400, "max_tokens")
        if num_prompt + max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the completion). "
                f"Please reduce the length of the messages or completion.", 400, "max_tokens")
        return max_tokens

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        vocab = self.engine.config.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"Token id {bad[0]} is out of vocabulary (size {vocab}).", 400, param)
        if not ids:
            raise APIError("The prompt is empty: give at least one token.", 400, param)

    @property
    def default_sampling(self) -> dict:
        """The model's generation-config defaults (EngineConfig.default_sampling)."""
        return getattr(self.engine.config, "default_sampling", None) or {}

    def sampling_params(self, fields: dict, renamed: dict[str, str] | None = None) -> SamplingParams:
        """Passes every field by name; one SamplingParams does not know yet is refused only if it is set.
        The request is checked against the model and the operator's limits here, before the engine sees
        it (the engine runs the same check for the library's callers). `renamed`: API field names for
        SamplingParams' (chat's top_logprobs is SamplingParams' logprobs)."""
        # Fields the request left unset take the model's generation-config defaults (max_tokens is settled
        # by max_tokens_for, so it is always in `fields`).
        fields = {**self.default_sampling, **fields}
        known = {}
        for name, value in fields.items():
            spec = _SAMPLING_FIELDS.get(name)
            if spec is not None:
                known[name] = value
            elif value not in (None, False, 0, [], {}):
                raise APIError(f"{name} is not supported yet.", 400, name)
        config = self.engine.config
        try:
            params = SamplingParams(**known)
            params.verify_for_model(config.model_config.vocab_size, config.args.max_logprobs, config.args.max_n)
            return params
        except (ValueError, TypeError) as e:
            message = str(e)
            param = _param_of(message)
            if param in (renamed or {}):
                param = renamed[param]
                message = param + message[message.index(" "):]
            raise APIError(message, 400, param) from None

    # ---- structured outputs ----------------------------------------------------------------------
    @property
    def structured_outputs_config(self) -> StructuredOutputsConfig:
        return StructuredOutputsConfig.from_json(getattr(self.engine.config.args, "structured_outputs_config", None))

    def grammar_compiler(self) -> GrammarCompiler:
        """This process's compiler: a request's constraint is compiled here first, so that a bad or too costly
        one is a 400 before the engine sees it (the engine compiles it again for its own matchers)."""
        if self._grammar_compiler is None:
            tokenizer = self.require_tokenizer("Structured output")
            model = self.engine.config.model_config
            stop = [t for t in [getattr(tokenizer, "eos_token_id", None), *model.eos_token_ids] if t is not None]
            self._grammar_compiler = GrammarCompiler(tokenizer, model.vocab_size, list(dict.fromkeys(stop)),
                                                     self.structured_outputs_config)
        return self._grammar_compiler

    async def constraint(self, req, plan=None, tool_parser: str | None = None) -> StructuredOutputsParams | None:
        """The request's one output constraint, compiled (400 when it is wrong or its compile is too slow)."""
        try:
            constraint = request_constraint(req, plan, tool_parser, self.structured_outputs_config.backend)
        except ValueError as e:
            raise APIError(str(e), 400, _param_of(str(e))) from None
        if constraint is None:
            return None
        compiler = self.grammar_compiler()
        await asyncio.wrap_future(compiler.warm_up())  # loading the libraries (once) is no part of the time limit
        future = compiler.submit(constraint)
        try:
            # shield: a timeout gives up waiting, it does not cancel the compile others may share
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(f"Compiling the {constraint.kind} constraint took longer than {COMPILE_TIMEOUT_S:g} s; "
                           f"simplify it.", 400, _param_of_constraint(req)) from None
        except ValueError as e:
            raise APIError(str(e), 400, _param_of_constraint(req)) from None
        return constraint

    # ---- running requests ------------------------------------------------------------------------
    async def add_requests(self, items: list[tuple[str, dict, SamplingParams]], raw: Request | None = None):
        """Adds every (request_id, prompt, params) as one batch; all or nothing, and engine rejections become
        400s. With `raw`, a client that leaves while they are being admitted has them all aborted."""
        work = self.engine.add_requests(items)
        try:
            if raw is None:
                return await work
            return await until_disconnect(raw, work, lambda: None)  # add_requests aborts on cancellation
        except ValueError as e:
            raise APIError(str(e), 400) from None
        except (EngineNotReadyError, EngineFailedError) as e:
            raise engine_error(e) from None

    def abort_all(self, streams) -> None:
        for s in streams:
            self.engine.abort(s.request_id)


async def merged(streams) -> AsyncIterator[tuple[int, object]]:
    """(position, output) from several request streams as they come (one stream: no tasks needed)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnect(raw: Request, work: Awaitable, on_disconnect) -> object:
    """Runs `work`; if the client goes away first, cancels it and calls `on_disconnect()` (abort + free)."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        on_disconnect()
        raise asyncio.CancelledError("client disconnected")
    return task.result()


def _param_of_constraint(req) -> str | None:
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "tools"):
        if getattr(req, name, None):
            return name
    return None


def _param_of(message: str) -> str | None:
    """Validation messages start with the field they are about ("n must be at most 128...")."""
    first = message.split(" ", 1)[0].rstrip(":")
    return first if first.replace("_", "").isalpha() and first.islower() else None


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, EngineNotReadyError):
        return APIError(str(e), 503)
    if isinstance(e, EngineFailedError):
        return APIError(str(e), 500)
    return APIError(f"{type(e).__name__}: {e}", 500)


class EventStreamResponse(StreamingResponse):
    """An SSE response that calls `on_close` however it ends (the last event sent, the client gone, a write
    that failed, a cancelled task), so the requests behind it are aborted at once, never left running."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(num_prompt: int, num_completion: int, num_preemptions: int = 0) -> dict:
    out = {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion}
    if num_preemptions:  # kvserve's addition: how often the engine evicted this request's K/V (KV cache too small)
        out["num_preemptions"] = num_preemptions
    return out


# ---- logprobs ------------------------------------------------------------------------------------
def _token_text(tokenizer, token_id: int, lp) -> str:
    text = getattr(lp, "decoded_token", None)
    if text is None:
        text = tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"
    return text


def _clamp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def completion_logprobs(token_ids: list[int], positions: list, tokenizer, text_offset: int = 0) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset.
    `positions[i]` is {token id: Logprob} (the chosen token among them), or None (first prompt token)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entries in zip(token_ids, positions):
        if entries is None:
            token, logprob, top = _token_text(tokenizer, tid, None), None, None
        else:
            chosen = entries.get(tid)
            token = _token_text(tokenizer, tid, chosen)
            logprob = _clamp(chosen.logprob) if chosen is not None else None
            top = {_token_text(tokenizer, t, e): _clamp(e.logprob) for t, e in entries.items()}
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(token)
    return out


def chat_logprobs(token_ids: list[int], positions: list, num_top: int, tokenizer) -> list[dict]:
    """`choices[].logprobs.content`: each token with its logprob, bytes and the `num_top` most likely."""
    content = []
    for tid, entries in zip(token_ids, positions):
        chosen = entries.get(tid) if entries else None
        token = _token_text(tokenizer, tid, chosen)
        alternatives = sorted(
            (e.rank, t, e) for t, e in (entries or {}).items() if e.rank is not None and 1 <= e.rank <= num_top)
        top = []
        for _, t, e in alternatives[:num_top]:
            text = _token_text(tokenizer, t, e)
            top.append({"token": text, "logprob": _clamp(e.logprob), "bytes": list(text.encode("utf-8", "replace"))})
        content.append({
            "token": token,
            "logprob": _clamp(chosen.logprob) if chosen is not None else _MIN_LOGPROB,
            "bytes": list(token.encode("utf-8", "replace")),
            "top_logprobs": top,
        })
    return content
