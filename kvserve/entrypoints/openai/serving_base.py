"""What /v1/completions and /v1/chat/completions share: model check, context-length check, SamplingParams
from a request, logprob formatting, usage, disconnect handling, deadlines and SSE framing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvserve.engine.async_engine import AsyncEngine, EngineFailedError, EngineNotReadyError, EngineOverloadedError
from kvserve.entrypoints.openai.admission import AdmissionLimits, check_request_id
from kvserve.entrypoints.openai.errors import APIError
from kvserve.entrypoints.openai.structured_request import request_constraint
from kvserve.entrypoints.openai.request_fields import check_fields
from kvserve.request_limits import (
    RequestLimits,
    ValidatedPrompt,
    check_token_ids,
    resolve_max_tokens,
    validate_request,
)
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output.compiler import GrammarCompiler, StructuredOutputsConfig
from kvserve.structured_output.limits import COMPILE_TIMEOUT_S
from kvserve.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("kvserve.server")

_SAMPLING_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp to this


# Tokenizing and detokenizing long texts runs here, off the event loop (the Rust tokenizer releases the GIL).
_TEXT_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvserve-tokenize")

# What the OpenAI python client sends as its timeout (seconds, the httpx read timeout): a non-streaming
# request is over for the client then, so the server stops working on it too.
CLIENT_TIMEOUT_HEADER = "x-stainless-read-timeout"


class ClientDisconnectedError(Exception):
    """The client went away before its answer was ready (its requests are already aborted): nothing to send,
    nothing to log (api_server answers it with an empty response that never leaves)."""


class RequestTimeoutError(Exception):
    """The request passed its deadline (--request-timeout or the client's own timeout) and was aborted."""


class Deadline:
    """When a request must be done, on the event loop's clock, and what set it."""

    def __init__(self, seconds: float, source: str):
        self.seconds = seconds
        self.source = source
        self.expires = asyncio.get_running_loop().time() + seconds
        self.request_id: str | None = None  # for the log line, once the request has one

    def remaining(self) -> float:
        return self.expires - asyncio.get_running_loop().time()

    def error(self) -> RequestTimeoutError:
        logger.warning("Request %s passed its deadline of %g s (%s); aborted.", self.request_id, self.seconds,
                       self.source)
        return RequestTimeoutError(f"The request did not finish within its deadline of {self.seconds:g} s "
                                   f"({self.source}) and was aborted.")


class ServingBase:
    def __init__(self, engine: AsyncEngine, served_model_name: str, response_role: str = "assistant",
                 chat_template: str | None = None, admission: AdmissionLimits | None = None,
                 request_timeout: float | None = None):
        self.engine = engine
        self.admission = admission or AdmissionLimits()
        self.served_model_name = served_model_name
        self.response_role = response_role
        self.chat_template = chat_template
        self.request_timeout = request_timeout  # --request-timeout (None: no server deadline)
        self._max_token_bytes: int | None = None
        self._grammar_compiler: GrammarCompiler | None = None

    def deadline(self, raw: Request | None, stream: bool) -> Deadline | None:
        """The earlier of --request-timeout and, for a non-streaming request, the OpenAI client's timeout
        (a stream's client timeout bounds the gap between chunks, not the whole stream)."""
        candidates = []
        if self.request_timeout:
            candidates.append((self.request_timeout, "--request-timeout"))
        if raw is not None and not stream:
            try:
                client = float(raw.headers.get(CLIENT_TIMEOUT_HEADER, ""))
            except ValueError:
                client = None
            if client is not None and 0 < client < float("inf"):
                candidates.append((client, f"the client's timeout, {CLIENT_TIMEOUT_HEADER}"))
        if not candidates:
            return None
        return Deadline(*min(candidates))

    # ---- text work, off the event loop -----------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Token ids of `text`, tokenized on a worker thread. A text so long that it cannot fit the context
        whatever its tokens (each token covers at most the vocabulary's longest token in bytes) is refused
        before it costs any tokenizer time."""
        tokenizer = self.check_text_size(text, param)
        return await asyncio.get_running_loop().run_in_executor(
            _TEXT_POOL, lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_text_size(self, text: str, param: str = "prompt"):
        """Refuses a text too long for the context whatever its tokens; returns the tokenizer."""
        tokenizer = self.require_tokenizer("A text prompt")
        num_bytes = len(text.encode("utf-8"))
        longest = self._longest_token_bytes(tokenizer)
        if num_bytes > self.max_model_len * longest:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens; the text has {num_bytes} "
                f"bytes, more than that many tokens can hold. Please shorten it.", 400, param)
        return tokenizer

    async def off_loop(self, fn, *args):
        """`fn(*args)` on a tokenizer thread: text work never stalls the event loop."""
        return await asyncio.get_running_loop().run_in_executor(_TEXT_POOL, fn, *args)

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
        """The model exists (404), the body's cross-field rules hold and its fan-out is within the admission
        limits (400); all before any prompt is tokenized."""
        self.check_model(req.model)
        try:
            req.check()
        except ValueError as e:
            raise APIError(str(e), 400, _param_of(str(e))) from None
        check_request_id(req.request_id)
        self.admission.check_fan_out(req.num_prompts, req.n, self.engine.config.args.max_n)
        check_fields(req)

    def truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """truncate_prompt_tokens as vLLM applies it: the last `keep` tokens (-1: the context length)."""
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len
        if keep > self.max_model_len:
            raise APIError(f"truncate_prompt_tokens ({keep}) is larger than the model's maximum context length "
                           f"({self.max_model_len}); choose a smaller value.", 400, "truncate_prompt_tokens")
        return token_ids[-keep:]

    def require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise APIError(f"{what} needs a tokenizer, and the server runs with --skip-tokenizer-init.", 400)
        return self.tokenizer

    @property
    def request_limits(self) -> RequestLimits:
        return RequestLimits.from_config(self.engine.config)

    def max_tokens_for(self, num_prompt: int, max_tokens: int | None) -> int:
        """vLLM's context check and messages; an unset max_tokens takes what is left of the context."""
        try:
            return resolve_max_tokens(num_prompt, max_tokens, self.request_limits, self.default_sampling.get("max_tokens"))
        except ValueError as e:
            raise APIError(str(e), 400, "max_tokens" if max_tokens is not None else "messages") from None

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        try:
            check_token_ids(ids, self.engine.config.model_config.vocab_size)
        except ValueError as e:
            raise APIError(str(e), 400, param) from None

    def validated(self, text: str | None, token_ids: list[int], params: SamplingParams,
                  renamed: dict[str, str] | None = None) -> ValidatedPrompt:
        """The request validator, run once per prompt here, before the engine sees it (which then takes the
        ValidatedPrompt as it is). `renamed`: API field names for SamplingParams' (chat's top_logprobs)."""
        try:
            return validate_request(text, token_ids, params, self.request_limits)
        except ValueError as e:
            raise _api_error(str(e), renamed, "prompt") from None

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
        try:
            return SamplingParams(**known)
        except (ValueError, TypeError) as e:
            raise _api_error(str(e), renamed) from None

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
    async def add_requests(self, items: list[tuple[str, ValidatedPrompt, SamplingParams]], raw: Request | None = None,
                           deadline: Deadline | None = None):
        """Adds every (request_id, prompt, params) as one batch; all or nothing, and engine rejections become
        400s. With `raw`, a client that leaves while they are being admitted has them all aborted."""
        work = self.engine.add_requests(items)
        try:
            if raw is None:
                return await work
            # add_requests aborts them all when cancelled
            return await until_disconnect(raw, work, lambda: None, deadline)
        except ValueError as e:
            raise APIError(str(e), 400) from None
        except EngineOverloadedError as e:
            raise APIError(str(e), 429, headers={"Retry-After": str(e.retry_after_s)}) from None
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


async def until_disconnect(raw: Request, work: Awaitable, on_disconnect, deadline: Deadline | None = None) -> object:
    """Runs `work`; if the client goes away first, or `deadline` passes, cancels it and calls
    `on_disconnect()` (abort + free), then raises ClientDisconnectedError or RequestTimeoutError."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    timeout = None if deadline is None else max(0.0, deadline.remaining())
    try:
        await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        on_disconnect()
        if watcher.done() and not watcher.cancelled():
            raise ClientDisconnectedError("client disconnected")
        raise deadline.error()
    return task.result()


def _param_of_constraint(req) -> str | None:
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "tools"):
        if getattr(req, name, None):
            return name
    return None


async def before_deadline(outputs, deadline: Deadline | None):
    """The items of the async iterator `outputs`, ending with RequestTimeoutError once `deadline` passes."""
    if deadline is None:
        async for item in outputs:
            yield item
        return
    iterator = outputs.__aiter__()
    while True:
        try:
            item = await asyncio.wait_for(iterator.__anext__(), max(0.0, deadline.remaining()))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise deadline.error() from None
        yield item


def _api_error(message: str, renamed: dict[str, str] | None, default_param: str | None = None) -> APIError:
    """A validation message as a 400 naming its field (in the API's spelling where `renamed` has one)."""
    param = _param_of(message)
    if param in (renamed or {}):
        param = renamed[param]
        message = param + message[message.index(" "):]
    return APIError(message, 400, param or default_param)


def _param_of(message: str) -> str | None:
    """Validation messages start with the field they are about ("n must be at most 128...")."""
    first = message.split(" ", 1)[0].rstrip(":")
    return first if first.replace("_", "").isalpha() and first.islower() else None


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestTimeoutError):
        return APIError(str(e), 504)
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


@dataclasses.dataclass(frozen=True)
class RequestCounts:
    """What usage reports, as the engine counted it (RequestMetrics): prompt and generated tokens; and
    kvserve's additions: how often the engine evicted the request's K/V (KV cache too small), and with
    speculative decoding its draft tokens verified and accepted."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @classmethod
    def of(cls, out) -> "RequestCounts":
        """The request's counts so far, from one of its RequestOutputs."""
        metrics = getattr(out, "metrics", None)
        return cls(getattr(metrics, "num_prompt_tokens", 0), getattr(metrics, "num_generation_tokens", 0),
                   getattr(out, "num_preemptions", 0), getattr(metrics, "num_draft_tokens", 0),
                   getattr(metrics, "num_accepted_tokens", 0))

    @classmethod
    def total(cls, counts) -> "RequestCounts":
        counts = list(counts)
        return cls(*(sum(getattr(c, f.name) for c in counts) for f in dataclasses.fields(cls)))


def usage(counts: RequestCounts) -> dict:
    num_prompt, num_completion = counts.num_prompt_tokens, counts.num_generation_tokens
    out = {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion}
    if counts.num_preemptions:
        out["num_preemptions"] = counts.num_preemptions
    if counts.num_draft_tokens:
        out["num_draft_tokens"] = counts.num_draft_tokens
        out["num_accepted_tokens"] = counts.num_accepted_tokens
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


def prompt_logprobs_json(positions, tokenizer) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank, decoded_token}}, None for the
    first (nothing precedes it)."""
    if positions is None:
        return None
    out = []
    for entries in positions:
        if entries is None:
            out.append(None)
            continue
        out.append({tid: {"logprob": _clamp(e.logprob), "rank": e.rank, "decoded_token": _token_text(tokenizer, tid, e)}
                    for tid, e in entries.items()})
    return out


def chat_logprobs(token_ids: list[int], positions: list, num_top: int, tokenizer) -> list[dict]:
    """`choices[].logprobs.content`: each token with its logprob, bytes and the `num_top` most likely."""
    content = []
    for tid, entries in zip(token_ids, positions):
        chosen = entries.get(tid) if entries else None
        token = _token_text(tokenizer, tid, chosen)
        limit = len(entries or ()) if num_top == -1 else num_top  # -1: the whole vocabulary
        alternatives = sorted(
            (e.rank, t, e) for t, e in (entries or {}).items() if e.rank is not None and 1 <= e.rank <= limit)
        top = []
        for _, t, e in alternatives[:limit]:
            text = _token_text(tokenizer, t, e)
            top.append({"token": text, "logprob": _clamp(e.logprob), "bytes": list(text.encode("utf-8", "replace"))})
        content.append({
            "token": token,
            "logprob": _clamp(chosen.logprob) if chosen is not None else _MIN_LOGPROB,
            "bytes": list(token.encode("utf-8", "replace")),
            "top_logprobs": top,
        })
    return content
