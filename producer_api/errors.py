"""One error body for every route, in OpenAI's shape so OpenAI clients read it as they expect:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": "..."}}

`code` is a `schemas.ErrorCode` value and `param` the offending field (every validation error
names one: "body" when the body itself is not JSON or not an object). Jobs routes answer with
the status `ErrorCode.http_status` gives; the OpenAI routes answer 400 where that is 422, as
OpenAI does for invalid requests and too-long contexts. `ErrorResponse` is the body's schema
and `error_responses` documents a route's error statuses with it in the OpenAPI file.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisFullError
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from producer_api.queue import QueueError, QueueFullError
from schemas import ErrorBody, ErrorCode
from schemas.errors import error_location, field_path

log = logging.getLogger(__name__)

OPENAI_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/v1/models",
    "/v1/files",
    "/v1/batches",
    "/tokenize",
    "/detokenize",
    "/generate",  # vLLM answers its bad input with 400 too
)

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
]
_ERROR_TYPES: dict[int, ErrorType] = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class ErrorDetail(BaseModel):
    message: str = Field(description="what went wrong, for people")
    type: ErrorType = Field(description="OpenAI's error class of the HTTP status")
    param: str | None = Field(description="the offending field, as a dotted path")
    code: ErrorCode = Field(description="a stable code clients can branch on")


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    error: ErrorDetail


_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before trying again",
        "schema": {"type": "integer"},
    }
}
_STATUS_DOCS: dict[int, dict[str, Any]] = {
    400: {
        "description": "Invalid request, a context too long (`context_length_exceeded`) or a "
        "token id outside the vocabulary (`invalid_token_id`): `param` names the field"
    },
    401: {"description": "Missing or unknown API key"},
    403: {"description": "Not allowed by this API's settings"},
    404: {"description": "No such job, file, batch or model (or not the caller's)"},
    408: {"description": "The job's deadline passed before it finished"},
    409: {"description": "Conflicts with the current state (e.g. cancelled meanwhile)"},
    413: {"description": "The request body is larger than the API accepts"},
    422: {
        "description": "Invalid request, a context too long (`context_length_exceeded`) or a "
        "token id outside the vocabulary (`invalid_token_id`): `param` names the field"
    },
    429: {"description": "The model's queue is full", "headers": _RETRY_AFTER},
    500: {"description": "The job failed in the engine, or an internal error"},
    503: {"description": "The queue (Redis) cannot be reached or is full", "headers": _RETRY_AFTER},
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI documentation of a route's error statuses, each with the ErrorResponse body."""
    return {status: {"model": ErrorResponse, **_STATUS_DOCS[status]} for status in statuses}


class ApiError(Exception):
    """Raised by routes: answered as the error body with `status` (default from the code)."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        param: str | None = None,
        *,
        status: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.error = ErrorBody.of(code, message, param)
        self.status = status
        self.headers = dict(headers or {})


def is_openai_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


def error_status(code: ErrorCode, path: str) -> int:
    status = code.http_status
    if status == 422 and is_openai_path(path):
        return 400
    return status


def error_payload(error: ErrorBody, status: int) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    detail = ErrorDetail(message=error.message, type=kind, param=error.param, code=error.code)
    return ErrorResponse(error=detail).model_dump(mode="json")


def error_response(
    error: ErrorBody,
    path: str,
    *,
    status: int | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    status = status or error_status(error.code, path)
    return JSONResponse(
        error_payload(error, status), status_code=status, headers=dict(headers or {})
    )


def queue_error_response(exc: QueueError, path: str, retry_after_s: int) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if isinstance(exc, QueueFullError) else None
    return error_response(exc.error, path, headers=headers)


def validation_error_body(exc: RequestValidationError) -> ErrorBody:
    """Name each bad field as the client wrote it (`messages.0.role`, not `body.messages...`);
    a body that is not JSON, or not an object, is the field `body`."""
    problems = []
    first_param = None
    for error in exc.errors():
        loc = error_location(error)
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        invalid_json = error.get("type") == "json_invalid"
        path = "body" if invalid_json else field_path(loc) or "body"
        if first_param is None:
            first_param = path
        problems.append(f"{path}: {'not valid JSON' if invalid_json else error['msg']}")
    return ErrorBody.of(
        ErrorCode.INVALID_REQUEST, "; ".join(problems) or "invalid request", first_param
    )


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.error, request.url.path, status=exc.status, headers=exc.headers)

    @app.exception_handler(QueueError)
    async def _queue_error(request: Request, exc: QueueError) -> JSONResponse:
        return queue_error_response(exc, request.url.path, retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error_body(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = ErrorCode.NOT_FOUND if exc.status_code == 404 else ErrorCode.INVALID_REQUEST
        body = ErrorBody.of(code, str(exc.detail))
        return error_response(body, request.url.path, status=exc.status_code, headers=exc.headers)

    # a master demoted by a failover answers READONLY until clients find the new one
    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    @app.exception_handler(RedisReadOnlyError)
    async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
        log.warning("Redis unavailable: %s", exc)
        body = ErrorBody.of(ErrorCode.UNAVAILABLE, "the queue (Redis) cannot be reached")
        return error_response(body, request.url.path, headers={"Retry-After": str(retry_after_s)})

    # maxmemory reached under noeviction: nothing is lost, new work must wait for results to expire
    @app.exception_handler(RedisFullError)
    async def _redis_full(request: Request, exc: RedisFullError) -> JSONResponse:
        log.warning("Redis is full (maxmemory): %s", exc)
        body = ErrorBody.of(
            ErrorCode.UNAVAILABLE, "the queue (Redis) is full: it takes new jobs as results expire"
        )
        return error_response(body, request.url.path, headers={"Retry-After": str(retry_after_s)})
