"""Refusals and failures as gRPC status codes, with the HTTP API's error code and the offending
field in the trailing metadata (`error-code`, `error-param`) and a full queue's retry hint
(`retry-after`, seconds)."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import NoReturn, Protocol, TypeVar

import grpc
from grpc import aio
from redis.exceptions import OutOfMemoryError as RedisFullError

from producer_api.auth import Unauthenticated
from producer_api.errors import ApiError
from producer_api.grpc.requests import message_field
from producer_api.queue import REDIS_UNAVAILABLE, QueueError
from schemas import ErrorBody, ErrorCode

log = logging.getLogger(__name__)

ERROR_CODE_KEY = "error-code"
ERROR_PARAM_KEY = "error-param"
RETRY_AFTER_KEY = "retry-after"

_STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.INVALID_TOKEN_ID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.INVALID_LORA_ADAPTER: grpc.StatusCode.INVALID_ARGUMENT,
    # the request names a model nobody serves: a bad argument (NOT_FOUND is for jobs)
    ErrorCode.MODEL_NOT_FOUND: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAUTHORIZED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.EXPIRED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.WORKER_LOST: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.MAX_ATTEMPTS_EXCEEDED: grpc.StatusCode.ABORTED,
}


# Refusals a client should retry after the hint (the queue full, Redis away).
_RETRYABLE = frozenset({ErrorCode.QUEUE_FULL, ErrorCode.RATE_LIMITED, ErrorCode.UNAVAILABLE})


def status_of(code: ErrorCode) -> grpc.StatusCode:
    return _STATUS.get(code, grpc.StatusCode.INTERNAL)


def _named(error: ErrorBody) -> tuple[str, str | None]:
    """The message and the param with the field as the gRPC message names it."""
    if error.param is None:
        return error.message, None
    param = message_field(error.param)
    message = error.message
    if message.startswith(f"{error.param}:"):
        message = param + message[len(error.param) :]
    elif not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    return message, param


async def abort(
    context: aio.ServicerContext, error: ErrorBody, retry_after_s: int | None = None
) -> NoReturn:
    message, param = _named(error)
    metadata = [(ERROR_CODE_KEY, error.code.value)]
    if param is not None:
        metadata.append((ERROR_PARAM_KEY, param))
    if retry_after_s is not None:
        metadata.append((RETRY_AFTER_KEY, str(retry_after_s)))
    await context.abort(status_of(error.code), message, tuple(metadata))
    raise AssertionError("context.abort returns only by raising")


def error_of(exc: Exception) -> ErrorBody | None:
    """The ErrorBody of a refusal or failure the servicer reports (None: a bug)."""
    if isinstance(exc, ApiError | QueueError):
        return exc.error
    if isinstance(exc, Unauthenticated):
        return ErrorBody.of(ErrorCode.UNAUTHORIZED, str(exc))
    if isinstance(exc, REDIS_UNAVAILABLE):
        return ErrorBody.of(ErrorCode.UNAVAILABLE, "the queue (Redis) cannot be reached")
    if isinstance(exc, RedisFullError):
        return ErrorBody.of(
            ErrorCode.UNAVAILABLE, "the queue (Redis) is full: it takes new jobs as results expire"
        )
    return None


async def _report(context: aio.ServicerContext, exc: Exception, retry_after_s: int) -> NoReturn:
    error = error_of(exc)
    if error is None:
        log.exception("unhandled error in a gRPC call")
        error = ErrorBody.of(ErrorCode.INTERNAL_ERROR, "internal error")
    elif error.code is ErrorCode.UNAVAILABLE:
        log.warning("gRPC call failed: %s", error.message)
    retry = error.code in _RETRYABLE
    await abort(context, error, retry_after_s if retry else None)


class Servicer(Protocol):
    retry_after_s: int  # the hint sent with a refusal worth retrying


Req = TypeVar("Req")
Resp = TypeVar("Resp")
Self = TypeVar("Self", bound=Servicer)


def unary_errors(
    method: Callable[[Self, Req, aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[Self, Req, aio.ServicerContext], Awaitable[Resp]]:
    """Every refusal or failure of a unary method answered as its status."""

    @wraps(method)
    async def call(self: Self, request: Req, context: aio.ServicerContext) -> Resp:
        try:
            return await method(self, request, context)
        except aio.AbortError:
            raise
        except Exception as exc:
            await _report(context, exc, self.retry_after_s)

    return call


def stream_errors(
    method: Callable[[Self, Req, aio.ServicerContext], AsyncGenerator[Resp, None]],
) -> Callable[[Self, Req, aio.ServicerContext], AsyncIterator[Resp]]:
    """The same for a server-streaming method (closed at once when the call ends)."""

    @wraps(method)
    async def call(self: Self, request: Req, context: aio.ServicerContext) -> AsyncIterator[Resp]:
        stream = method(self, request, context)
        try:
            async for item in stream:
                yield item
        except aio.AbortError:
            raise
        except Exception as exc:
            await _report(context, exc, self.retry_after_s)
        finally:
            await stream.aclose()

    return call
