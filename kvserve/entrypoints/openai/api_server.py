"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine, run by uvicorn.

The port opens at once and answers 503 while the model loads (so orchestrators can probe /health); on
SIGTERM/SIGINT it answers 503 to new requests while in-flight streams finish (bounded by
--shutdown-timeout: streams still running then get an error event and [DONE]), stops the engine and exits
0. The engine's processes ignore those signals, so a signal to the whole process group (systemd,
Kubernetes) drains the same way. If the engine core dies, every request (and /health) answers 500 and
the server exits 1; if it stops answering (a hung step, SIGSTOP) for --engine-heartbeat-timeout, /health
answers 503 until it answers again. SIGUSR1 writes every thread's stack to the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import kvserve
from kvserve import log_safety
from kvserve.config import EngineArgs
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.metrics import EngineMetrics
from kvserve.entrypoints.openai import thread_stacks
from kvserve.entrypoints.openai.admission import AdmissionLimits
from kvserve.entrypoints.openai.chat_renderer import DEFAULT_TIMEOUT_S
from kvserve.entrypoints.openai.cli_args import (
    DEFAULT_ENGINE_HEARTBEAT_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT_CONNECTIONS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
)
from kvserve.entrypoints.openai.dashboard import DASHBOARD_PAGE, add_dashboard_routes
from kvserve.entrypoints.openai.errors import APIError, error_response, install_error_handlers
from kvserve.entrypoints.openai.host_check import HostCheckMiddleware, is_loopback
from kvserve.entrypoints.openai.http_limits import BodyLimitMiddleware, fit_connection_limit, limited_protocol
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.entrypoints.openai.tool_parsers import check_tool_flags
from kvserve.entrypoints.openai.serving_base import ClientDisconnectedError, RequestTimeoutError
from kvserve.entrypoints.openai.serving_chat import ServingChat
from kvserve.entrypoints.openai.serving_completion import ServingCompletion

logger = logging.getLogger("kvserve.server")

STATS_LOG_INTERVAL_S = 10.0
# Open like vLLM's: probes and scrapers carry no API key.
# (/dashboard is the page's empty shell; its data, /dashboard/snapshot, needs the key like /v1.)
_UNAUTHENTICATED_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", DASHBOARD_PAGE})
# Answerable while the model loads or the server drains.
_ALWAYS_AVAILABLE_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", DASHBOARD_PAGE})


@dataclass
class ServerSettings:
    served_model_name: str
    model_path: str
    api_key: str | None = None
    response_role: str = "assistant"
    chat_template: str | None = None
    disable_log_stats: bool = False
    enable_log_requests: bool = False
    trust_request_chat_template: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    chat_template_timeout: float = DEFAULT_TIMEOUT_S
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    shutdown_timeout: float = 30.0
    tool_call_parser: str | None = None  # --tool-call-parser, with --enable-auto-tool-choice
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S
    request_timeout: float | None = None
    engine_heartbeat_timeout: float = DEFAULT_ENGINE_HEARTBEAT_TIMEOUT_S
    host: str = "127.0.0.1"
    port: int = 8000
    allowed_hosts: tuple[str, ...] = ()
    chat_template_workers: int | None = None
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)


@dataclass
class ServerState:
    """What the routes, the middleware and the signal handler share (one per app, no globals)."""

    engine: AsyncEngine
    metrics: EngineMetrics
    settings: ServerSettings
    draining: bool = False
    exit_code: int = 0
    request_exit: object = None  # callable set by the runner: stop uvicorn (engine failed to start)
    loop: asyncio.AbstractEventLoop | None = None
    on_ready: object = None  # callable run (off the loop) once the engine is up: starts the chat renderer


class _GateMiddleware:
    """API key, then "starting"/"draining" 503s; plain ASGI so streaming and disconnects pass untouched."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        key = state.settings.api_key
        self._key = key.encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self._key is not None and path not in _UNAUTHENTICATED_PATHS and not self._authorized(scope):
            return await error_response("Invalid or missing API key (send 'Authorization: Bearer <key>').", 401)(
                scope, receive, send)
        if getattr(self.state.engine, "is_dead", False) and path not in ("/metrics", "/version"):
            return await error_response(str(self.state.engine.dead_error), 500)(scope, receive, send)
        if path not in _ALWAYS_AVAILABLE_PATHS:
            if self.state.draining:
                return await error_response("The server is shutting down.", 503)(scope, receive, send)
            if not self.state.engine.is_ready:
                return await error_response("The model is still loading; retry shortly.", 503)(scope, receive, send)
        return await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # Constant time: the comparison must not reveal how much of a guess was right.
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False


def build_app(state: ServerState) -> FastAPI:
    engine, metrics, settings = state.engine, state.metrics, state.settings

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        engine.start()
        tasks = [asyncio.create_task(_watch_startup(state)), asyncio.create_task(_watch_engine_death(state))]
        if not settings.disable_log_stats:
            tasks.append(asyncio.create_task(_log_stats(metrics)))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            chat.close()
            await engine.shutdown()
            logger.info("Engine stopped")

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan)
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnectedError)
    async def _client_left(request: Request, exc: ClientDisconnectedError):
        return Response(status_code=499)  # nobody reads it: the point is no traceback in the log

    @app.exception_handler(RequestTimeoutError)
    async def _past_deadline(request: Request, exc: RequestTimeoutError):
        return error_response(str(exc), 504)

    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes,
                       idle_timeout_s=settings.header_timeout, body_timeout_s=settings.request_body_timeout)
    app.add_middleware(_GateMiddleware, state=state)
    if is_loopback(settings.host) and not settings.api_key:
        app.add_middleware(HostCheckMiddleware, bind_host=settings.host, port=settings.port,
                           allowed_hosts=settings.allowed_hosts)  # added last: runs first
    renderer_options = {"timeout_s": settings.chat_template_timeout}
    if settings.chat_template_workers:
        renderer_options["num_workers"] = settings.chat_template_workers
    chat = ServingChat(engine, settings.served_model_name, settings.response_role, settings.chat_template,
                       trust_request_chat_template=settings.trust_request_chat_template,
                       request_timeout=settings.request_timeout, tool_call_parser=settings.tool_call_parser, admission=settings.admission, **renderer_options)
    state.on_ready = chat.start_renderer
    completion = ServingCompletion(engine, settings.served_model_name, request_timeout=settings.request_timeout,
                                   admission=settings.admission)
    add_dashboard_routes(app, engine, metrics, settings.served_model_name)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if getattr(engine, "is_dead", False):
            return error_response(str(engine.dead_error), 500)
        if state.draining:
            return error_response("The server is shutting down.", 503)
        if not engine.is_ready:
            return error_response("The model is still loading.", 503)
        silent = engine.seconds_since_heard()
        if silent is not None and silent > settings.engine_heartbeat_timeout:
            return error_response(
                f"The engine has not completed a step or answered a heartbeat for {silent:.0f} s "
                f"(--engine-heartbeat-timeout {settings.engine_heartbeat_timeout:g}).", 503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST", "HEAD"])
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": kvserve.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": settings.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kvserve", "root": settings.model_path, "parent": None,
            "max_model_len": engine.config.max_model_len, "permission": [],
        }]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        _log_request(settings, "completion", body)
        return await completion.create(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        _log_request(settings, "chat", body)
        return await chat.create(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        chat.check_model(body.model)
        chat.require_tokenizer("/tokenize")
        if (body.prompt is None) == (body.messages is None):
            raise APIError("Give exactly one of prompt and messages.", 400)
        if body.messages is not None:
            _, tokens = await chat.render_and_encode(
                body.messages, body.add_generation_prompt, body.continue_final_message, body.chat_template,
                body.chat_template_kwargs, bool(body.add_special_tokens))  # the template already placed them
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await chat.encode(body.prompt, special, "prompt")
        return {"count": len(tokens), "max_model_len": engine.config.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        chat.check_model(body.model)
        chat.require_tokenizer("/detokenize")
        chat.check_token_ids(body.tokens, "tokens")
        return {"prompt": await chat.decode(body.tokens)}

    return app


def _log_request(settings: ServerSettings, kind: str, body) -> None:
    if settings.enable_log_requests:
        logger.info("%s request: %s", kind, body.model_dump_json(exclude_none=True)[:2000])


async def _watch_startup(state: ServerState) -> None:
    t0 = time.perf_counter()
    try:
        await state.engine.ready()
    except Exception:  # noqa: BLE001 - logged by the engine thread; a server without a model must exit
        logger.error("The engine failed to start; shutting down.")
        state.exit_code = 1
        if state.request_exit is not None:
            state.request_exit()
        return
    if state.on_ready is not None:
        await asyncio.get_running_loop().run_in_executor(None, state.on_ready)
    logger.info("Ready: serving %s (max_model_len %d) after %.1f s", state.settings.served_model_name,
                state.engine.config.max_model_len, time.perf_counter() - t0)


async def _watch_engine_death(state: ServerState) -> None:
    """A dead engine core cannot come back: fail fast and exit non-zero, so a supervisor restarts us."""
    error = await state.engine.wait_dead()
    logger.error("%s", error)
    state.exit_code = 1
    if state.request_exit is not None:
        state.request_exit()


async def _log_stats(metrics: EngineMetrics) -> None:
    while True:
        await asyncio.sleep(STATS_LOG_INTERVAL_S)
        metrics.log.maybe_log()


class _Server(uvicorn.Server):
    """uvicorn, except that a signal first drains: the port stays open and answers 503 to new requests while
    in-flight ones finish, for at most --shutdown-timeout; streams still running then end with an error
    event and [DONE]. Then uvicorn stops and the process exits 0 (or 1 if the engine died)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining:
            if sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for streams
            self.should_exit = True
            return
        logger.info("Received %s: draining in-flight requests, then exiting.", signal.Signals(sig).name)
        self.state.draining = True
        loop = self.state.loop
        if loop is None or not self.state.engine.is_ready:
            self.should_exit = True
            return
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        engine, timeout = self.state.engine, self.state.settings.shutdown_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while engine.num_active and loop.time() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        if engine.num_active:
            logger.warning("Shutdown timeout (%.0f s): ending %d unfinished request(s) with an error.",
                           timeout, engine.num_active)
            engine.abort_all(f"The server shut down before this request finished (--shutdown-timeout {timeout:g} s).")
        self.should_exit = True


def read_chat_template(value: str | None) -> str | None:
    """--chat-template is a file path or the jinja2 text itself (as in vLLM)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if len(value) < 4096 and path.is_file():
        return path.read_text()
    return value


def _note_flags_without_effect(args: EngineArgs, config) -> None:
    """Flags that cannot act on this machine or with these settings say so, rather than nothing."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    if config.device == "cpu" and args.gpu_memory_utilization != defaults["gpu_memory_utilization"]:
        logger.warning("--gpu-memory-utilization has no effect on CPU: the KV cache there is "
                       "--kv-cache-memory-bytes (default 2 GiB).")
    if args.swap_space and args.preemption_mode == "recompute":
        logger.warning("--swap-space has no effect with --preemption-mode recompute (the default): preempted "
                       "requests are recomputed; add --preemption-mode swap or auto to use it.")


def run_server(engine_args: EngineArgs, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               uvicorn_log_level: str = "info", chat_template: str | None = None, response_role: str = "assistant",
               disable_log_stats: bool = False, enable_log_requests: bool = False,
               shutdown_timeout: float = 30.0, trust_request_chat_template: bool = False,
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
               header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
               chat_template_timeout: float = DEFAULT_TIMEOUT_S, admission: AdmissionLimits | None = None,
               request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S,
               max_concurrent_connections: int = DEFAULT_MAX_CONCURRENT_CONNECTIONS,
               request_timeout: float | None = None,
               engine_heartbeat_timeout: float = DEFAULT_ENGINE_HEARTBEAT_TIMEOUT_S,
               allowed_hosts: tuple[str, ...] = (), chat_template_workers: int | None = None,
               enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None) -> int:
    config = engine_args.create_engine_config()  # bad flags fail here, before the port opens
    _note_flags_without_effect(engine_args, config)
    tool_call_parser = check_tool_flags(enable_auto_tool_choice, tool_call_parser)
    settings = ServerSettings(
        served_model_name=config.served_model_name,
        model_path=str(config.model_path),
        api_key=api_key or os.environ.get("KVSERVE_API_KEY") or os.environ.get("VLLM_API_KEY") or None,
        response_role=response_role,
        chat_template=read_chat_template(chat_template),
        disable_log_stats=disable_log_stats,
        enable_log_requests=enable_log_requests,
        trust_request_chat_template=trust_request_chat_template,
        max_request_body_bytes=max_request_body_bytes,
        chat_template_timeout=chat_template_timeout,
        header_timeout=header_timeout,
        shutdown_timeout=shutdown_timeout,
        tool_call_parser=tool_call_parser,
        request_body_timeout=request_body_timeout,
        request_timeout=request_timeout,
        engine_heartbeat_timeout=engine_heartbeat_timeout,
        host=host,
        port=port,
        allowed_hosts=tuple(allowed_hosts),
        chat_template_workers=chat_template_workers,
        admission=admission or AdmissionLimits(),
    )
    metrics = EngineMetrics(settings.served_model_name)
    engine = AsyncEngine(config, metrics, max_waiting_sequences=settings.admission.max_waiting_requests)
    state = ServerState(engine=engine, metrics=metrics, settings=settings)
    app = build_app(state)
    # The drain (above) already waited for the requests; uvicorn's own wait only flushes their last bytes.
    max_connections = fit_connection_limit(max_concurrent_connections)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level,
                               timeout_graceful_shutdown=10, timeout_keep_alive=5,
                               http=limited_protocol(header_timeout, max_connections))
    log_safety.install()  # after uvicorn's logging set-up
    # A shutdown or request that seems stuck can be looked into without a debugger: `kill -USR1 PID`.
    thread_stacks.install(signal.SIGUSR1)
    server = _Server(uv_config, state)

    def request_exit():
        state.draining = True
        server.should_exit = True

    state.request_exit = request_exit

    def engine_crashed():  # e.g. a worker process died: /health turns 503 and the server exits 1
        logger.error("The engine died; shutting down with exit code 1.")
        state.exit_code = 1
        request_exit()

    state.engine.on_crashed = engine_crashed
    logger.info("Starting server on http://%s:%d (model %s)", host, port, settings.served_model_name)
    server.run()
    return state.exit_code

