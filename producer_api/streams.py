"""asyncio helpers of the OpenAI routes: stop waiting when the client leaves, and interleave
the chunk streams of several jobs (one per prompt) as they come."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected while the server was still working for it."""


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first (then ClientGone; work is cancelled).
    Only for handlers that have read their whole body already."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending


async def merge_indexed(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of all streams as they arrive, each tagged with its stream's position. Each stream
    is consumed by one task of its own, so per-stream order is kept."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    inbox: asyncio.Queue[tuple[int, T] | tuple[int, BaseException | None]] = asyncio.Queue()
    done_marker = object()

    async def pump(position: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await inbox.put((position, item))
            await inbox.put((position, done_marker))  # type: ignore[arg-type]
        except Exception as exc:  # handed to the consumer, raised there
            await inbox.put((position, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            position, item = await inbox.get()
            if item is done_marker:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield position, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
