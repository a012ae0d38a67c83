"""Server-Sent Events: the wire format, keep-alive comments, and a response that notices at once
when the client goes away (so the Redis subscription behind it is closed at once too)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from producer_api.metrics import ApiMetrics

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx and friends: don't buffer the stream
}
KEEPALIVE = b": keep-alive\n\n"


def sse_event(data: str, *, event: str | None = None, event_id: str | None = None) -> bytes:
    """One event. `data` may hold newlines: each line becomes its own `data:` field."""
    lines = []
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
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client's disconnect (whatever the ASGI
    spec version) and counts itself in the open-SSE-connections gauge."""

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
            with_keepalive(events, keepalive_s),
            status_code=status_code,
            headers={**SSE_HEADERS, **(headers or {})},
        )
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
