"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

Type names are vLLM's (BadRequestError, NotFoundError, ...), so clients that switch on them behave alike.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.entrypoints.openai.not_served import not_served_message

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeoutError",
    421: "MisdirectedRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers


def error_body(message: str, status: int, param: str | None = None) -> dict:
    err_type = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(message: str, status: int, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def sse_error(message: str, status: int) -> str:
    """An error in the middle of a stream, as vLLM sends it: one data event before [DONE]."""
    return f"data: {json.dumps(error_body(message, status))}\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"Malformed JSON in the request body: {first.get('ctx', {}).get('error', first.get('msg'))}.", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    parts = []
    for e in errors[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.message, exc.status, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        # FastAPI says 422; OpenAI and vLLM say 400.
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = not_served_message(request.url.path)
            if message is not None:
                return error_response(message, 404)
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("Unhandled error in %s %s", request.method, request.url.path)
        return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)
