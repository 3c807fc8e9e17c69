"""`kvserve serve [MODEL] [engine flags] [server flags]`: vLLM's `vllm serve` command line.

Engine flags come from the EngineArgs dataclass (cli_args.add_engine_args), so they cannot drift from the
library; only the HTTP server's own flags are declared here.
"""

from __future__ import annotations

import argparse

from kvserve.entrypoints.cli_args import add_engine_args, engine_args_from_namespace
from kvserve.entrypoints.openai.admission import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    DEFAULT_MAX_WAITING_REQUESTS,
    AdmissionLimits,
)
from kvserve.entrypoints.openai.chat_renderer import DEFAULT_TIMEOUT_S, DEFAULT_WORKERS
from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kvserve.entrypoints.vllm_flags import add_vllm_flags

# The HTTP limits' defaults live with their flags: building this parser (every `kvserve` command does) must
# not import the server's dependencies (uvicorn, fastapi), which a machine that only runs the library may lack.
DEFAULT_MAX_REQUEST_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_REQUEST_BODY_TIMEOUT_S = 60.0
DEFAULT_MAX_CONCURRENT_CONNECTIONS = 2048
DEFAULT_ENGINE_HEARTBEAT_TIMEOUT_S = 10.0

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Server options")
    g.add_argument("--host", default="127.0.0.1",
                   help="Address to listen on; 0.0.0.0 makes the server reachable from other machines (default: "
                        "127.0.0.1, this machine only).")
    g.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    g.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer KEY' on the API (/health, /metrics and /version stay open). "
                        "Also read from $KVSERVE_API_KEY or $VLLM_API_KEY.")
    g.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS, help="uvicorn's log level.")
    g.add_argument("--chat-template", default=None,
                   help="Jinja2 chat template, as a file path or inline text (default: the tokenizer's).")
    g.add_argument("--response-role", default="assistant", help="Role of generated chat messages.")
    g.add_argument("--disable-log-stats", action="store_true", help="No periodic throughput log line.")
    g.add_argument("--enable-log-requests", action="store_true", help="Log each request's parameters.")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="Accepted for vLLM compatibility (requests are not logged unless --enable-log-requests).")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="On SIGTERM/SIGINT, seconds to let in-flight requests finish before exiting (default: 30); "
                        "new requests meanwhile get 503, and streams still running at the end get an error event.")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="Accept a chat_template in chat requests (refused by default, as in vLLM).")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="Largest request body accepted, in bytes; larger ones get 413 "
                        f"(default: {DEFAULT_MAX_REQUEST_BODY_BYTES}).")
    g.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="Seconds a client has to send a request's headers before its connection is closed, and "
                        f"the longest pause allowed within a request body (408) (default: {DEFAULT_HEADER_TIMEOUT_S:g}).")
    g.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                   help="Most prompts one /v1/completions request may list; more get 400 "
                        f"(default: {DEFAULT_MAX_PROMPTS_PER_REQUEST}).")
    g.add_argument("--max-sequences-per-request", type=int, default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                   help="Most sequences (prompts x n) one request may start; more get 400 "
                        f"(default: {DEFAULT_MAX_SEQUENCES_PER_REQUEST}).")
    g.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="Most sequences that may wait beyond the --max-num-seqs running ones; a request that would "
                        f"queue more gets 429 with Retry-After (default: {DEFAULT_MAX_WAITING_REQUESTS}).")
    g.add_argument("--chat-template-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="Seconds one chat template render may take before it is stopped and the request "
                        f"gets 400 (default: {DEFAULT_TIMEOUT_S:g}).")
    g.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                   help='Let the model decide when to call a tool (tool_choice "auto"); needs --tool-call-parser. '
                        '"required" and named tool choices work without it.')
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="How the model writes tool calls: hermes | llama3_json | mistral | pythonic.")
    g.add_argument("--chat-template-workers", type=_positive_int, default=DEFAULT_WORKERS,
                   help="Chat template renders that run at once, each in a worker process "
                        f"(default: {DEFAULT_WORKERS}, the CPU count up to 4).")
    g.add_argument("--request-body-timeout", type=_positive_float, default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
                   help="Seconds a client has, after its headers, to send the whole request body (in total, "
                        f"however it trickles); then 408 (default: {DEFAULT_REQUEST_BODY_TIMEOUT_S:g}).")
    g.add_argument("--max-concurrent-connections", type=_positive_int, default=DEFAULT_MAX_CONCURRENT_CONNECTIONS,
                   help="Open connections at most; one more is answered 503 and closed at once (default: "
                        f"{DEFAULT_MAX_CONCURRENT_CONNECTIONS}; the descriptor limit is raised to fit).")
    g.add_argument("--request-timeout", type=_positive_float, default=None,
                   help="Seconds a completion may take from arrival to its last token; past it the request is "
                        "aborted with 504 (streams: an error event, then [DONE]). Default: none. A non-streaming "
                        "request also ends at the OpenAI client's timeout (its X-Stainless-Read-Timeout header).")
    g.add_argument("--engine-heartbeat-timeout", type=_positive_float, default=10.0,
                   help="Seconds without a step or a heartbeat from the engine after which /health answers 503 "
                        "(a hung or stopped engine), until it answers again (default: 10).")
    g.add_argument("--allowed-hosts", action="append", default=[], metavar="NAME[,NAME...]",
                   help="Host header values served besides localhost, 127.0.0.1 and [::1] when the server "
                        "listens on loopback without --api-key (others get 421, against DNS rebinding); a "
                        "name, or name:port for that port only.")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="Start the OpenAI-compatible HTTP server.",
        description="Start the OpenAI-compatible HTTP server (same flags as `vllm serve`).",
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
    p.add_argument("--model", default=None, help="Same as MODEL (vLLM accepts both).")
    add_server_args(p)
    add_engine_args(p)
    add_vllm_flags(p)  # last: it answers only the vLLM flags the parser above does not define
    p.set_defaults(func=cmd_serve)


def cmd_serve(ns: argparse.Namespace) -> int:
    from kvserve.entrypoints.openai.api_server import run_server

    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise ValueError(f"Two different models given: {ns.model_tag!r} and --model {ns.model!r}.")
    args = engine_args_from_namespace(ns, ns.model_tag or ns.model)
    return run_server(
        args, host=ns.host, port=ns.port, api_key=ns.api_key, uvicorn_log_level=ns.uvicorn_log_level,
        chat_template=ns.chat_template, response_role=ns.response_role, disable_log_stats=ns.disable_log_stats,
        enable_log_requests=ns.enable_log_requests, shutdown_timeout=ns.shutdown_timeout,
        trust_request_chat_template=ns.trust_request_chat_template, max_request_body_bytes=ns.max_request_body_bytes,
        header_timeout=ns.header_timeout, chat_template_timeout=ns.chat_template_timeout,
        enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser,
        request_body_timeout=ns.request_body_timeout, max_concurrent_connections=ns.max_concurrent_connections,
        request_timeout=ns.request_timeout, engine_heartbeat_timeout=ns.engine_heartbeat_timeout,
        allowed_hosts=tuple(name.strip() for entry in ns.allowed_hosts for name in entry.split(",") if name.strip()),
        chat_template_workers=ns.chat_template_workers,
        admission=AdmissionLimits(ns.max_prompts_per_request, ns.max_sequences_per_request, ns.max_waiting_requests),
    )
