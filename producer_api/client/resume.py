"""Resuming chunk streams: after a dropped connection, reopen after the last chunk seen.

Both transports number chunks, so a stream reopened with the last index seen continues
without a gap or a repeat; this only decides when to retry and how long to wait."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from producer_api.client.base import close_stream
from schemas import TokenChunk

DEFAULT_MAX_RETRIES = 5
_BACKOFF_S = (0.05, 0.2, 0.5, 1.0, 2.0)
T = TypeVar("T")


def backoff_s(attempt: int) -> float:
    return _BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)]


async def resuming_stream(
    open_stream: Callable[[int], AsyncIterator[TokenChunk]],
    last_index: int,
    retry_on: tuple[type[BaseException], ...],
    max_retries: int = DEFAULT_MAX_RETRIES,
) -> AsyncIterator[TokenChunk]:
    """Chunks after `last_index` from `open_stream(last_index)`, reopened after an error in
    `retry_on` (up to `max_retries` failures in a row without a new chunk)."""
    failures = 0
    while True:
        stream = open_stream(last_index)
        try:
            async for chunk in stream:
                if chunk.index <= last_index:
                    continue
                last_index = chunk.index
                failures = 0
                yield chunk
            return
        except retry_on:
            failures += 1
            if failures > max_retries:
                raise
        finally:
            await close_stream(stream)
        await asyncio.sleep(backoff_s(failures - 1))


async def retrying(
    call: Callable[[], Awaitable[T]],
    retry_on: tuple[type[BaseException], ...],
    max_retries: int = DEFAULT_MAX_RETRIES,
) -> T:
    """`call()`'s answer, called again after an error in `retry_on` (up to `max_retries` failures
    in a row): for reads that are safe to repeat while Redis fails over."""
    failures = 0
    while True:
        try:
            return await call()
        except retry_on:
            failures += 1
            if failures > max_retries:
                raise
        await asyncio.sleep(backoff_s(failures - 1))
