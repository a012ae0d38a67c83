"""Server-Sent Events: the wire format, keep-alive comments, and a response that notices at once
when the client goes away (so the Redis subscription behind it is closed at once too), and that
ends with an error event the client can act on when Redis goes away under it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from producer_api.errors import error_payload, error_status, is_openai_path
from producer_api.metrics import ApiMetrics
from producer_api.queue import REDIS_UNAVAILABLE, QueueError
from schemas import ErrorBody, ErrorCode

log = logging.getLogger(__name__)

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx and friends: don't buffer the stream
}
KEEPALIVE = b": keep-alive\n\n"
# How long an EventSource waits before it reconnects after a stream ended by an outage.
RECONNECT_AFTER_MS = 1000
# What ends a stream with an error event rather than a traceback.
STREAM_FAILURES: tuple[type[Exception], ...] = (*REDIS_UNAVAILABLE, QueueError)


def sse_event(
    data: str,
    *,
    event: str | None = None,
    event_id: str | None = None,
    retry_ms: int | None = None,
) -> bytes:
    """One event. `data` may hold newlines: each line becomes its own `data:` field. `retry_ms`
    tells an EventSource how long to wait before it reconnects."""
    lines = []
    if retry_ms is not None:
        lines.append(f"retry: {retry_ms}")
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


async def with_keepalive(events: AsyncIterator[bytes], interval_s: float) -> AsyncIterator[bytes]:
    """The events, plus a comment line whenever none came for `interval_s` (proxies close idle
    connections, and a write is how a server learns that the client has gone)."""
    pending: asyncio.Task[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        # Shielded: this runs while the response is being cancelled, and the generator behind
        # (a Redis subscription) must still be closed properly.
        with anyio.CancelScope(shield=True):
            if pending is not None:
                pending.cancel()
                await asyncio.wait({pending})
            await _close(events)


def failure_event(path: str, exc: Exception) -> bytes:
    """The last event of a stream on `path` that `exc` (Redis unreachable, or a QueueError)
    ended. On the jobs stream: `event: error` with the error body and a reconnect delay, as the
    client may resume with Last-Event-ID. On the OpenAI routes, whose streams cannot resume:
    OpenAI's error object, which the OpenAI SDKs raise."""
    openai = is_openai_path(path)
    if isinstance(exc, QueueError):
        error = exc.error
    else:
        then = (
            "the stream ended early; retry the request"
            if openai
            else "reconnect with Last-Event-ID to resume after the last chunk received"
        )
        error = ErrorBody.of(ErrorCode.UNAVAILABLE, f"the queue (Redis) cannot be reached; {then}")
    if openai:
        payload = error_payload(error, error_status(error.code, path))
        return sse_event(json.dumps(payload, separators=(",", ":")), event="error")
    retry_ms = RECONNECT_AFTER_MS if error.code is ErrorCode.UNAVAILABLE else None
    return sse_event(error.model_dump_json(exclude_none=True), event="error", retry_ms=retry_ms)


async def ending_on_failure(events: AsyncIterator[bytes], path: str) -> AsyncIterator[bytes]:
    """The events; if Redis becomes unreachable (or the queue fails) on the way, one
    `failure_event` instead of the rest, and one log line rather than a traceback."""
    try:
        async for item in events:
            yield item
    except STREAM_FAILURES as exc:
        log.warning("stream %s ended with an error event: %s", path, _reason(exc))
        yield failure_event(path, exc)
    finally:
        # Closing a stream the client left runs its clean-up, which may need Redis too (the
        # OpenAI routes cancel their jobs when a stream ends early).
        try:
            await _close(events)
        except REDIS_UNAVAILABLE as exc:
            log.warning("stream %s: clean-up failed: %s", path, _reason(exc))


def _reason(exc: Exception) -> str:
    if isinstance(exc, QueueError):
        return f"{exc.code.value}: {exc}"
    return f"Redis unreachable mid-stream ({type(exc).__name__}: {exc})"


async def _close(events: AsyncIterator[bytes]) -> None:
    if isinstance(events, AsyncGenerator):
        await events.aclose()


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client's disconnect (whatever the ASGI
    spec version), counts itself in the open-SSE-connections gauge, and ends with an error event
    (see `ending_on_failure`) when Redis goes away mid-stream."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        metrics: ApiMetrics,
        *,
        keepalive_s: float,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            events, status_code=status_code, headers={**SSE_HEADERS, **(headers or {})}
        )
        self.events = events
        self.metrics = metrics
        self.keepalive_s = keepalive_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The error event's shape depends on the route, known once the response is sent.
        self.body_iterator = with_keepalive(
            ending_on_failure(self.events, scope["path"]), self.keepalive_s
        )
        self.metrics.sse_connections.inc()
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.metrics.sse_connections.dec()
