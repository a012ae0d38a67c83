"""A small client that talks to Redis directly: enqueue, get, wait, stream, cancel.

    async with AsyncRedisClient("redis://localhost:6379/0") as client:
        job = await client.enqueue(model="SmolLM2-135M-Instruct", prompt="Hi", stream=True)
        async for chunk in client.stream(job.id):
            print(chunk.text, end="")

    with RedisClient("redis://localhost:6379/0") as client:   # the same, for sync code
        job = client.run(model="SmolLM2-135M-Instruct", prompt="Hi", timeout=60)
        print(job.result.choices[0].text)

Both are thin wrappers over `producer_api.queue`, the functions the HTTP API uses too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from redis.asyncio import Redis

from producer_api import queue
from schemas import DEFAULT_PREFIX, Job, JobRequest, RedisKeys, TokenChunk

T = TypeVar("T")
DEFAULT_URL = "redis://localhost:6379/0"


def as_request(
    request: JobRequest | Mapping[str, Any] | None, fields: Mapping[str, Any]
) -> JobRequest:
    """A JobRequest from a JobRequest, a dict, and/or keyword fields (validated here)."""
    if isinstance(request, JobRequest):
        if fields:
            return JobRequest.model_validate({**request.model_dump(exclude_none=True), **fields})
        return request
    return JobRequest.model_validate({**(request or {}), **fields})


async def _next(chunks: AsyncIterator[T]) -> T:
    return await anext(chunks)


class AsyncRedisClient:
    """asyncio client. Give it a URL (it owns the connection pool) or a `redis.asyncio.Redis`."""

    def __init__(
        self,
        redis: Redis | str = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        owner: str | None = None,
        max_queue_len: int | None = None,
        poll_interval: float = queue.DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        self._owns_redis = isinstance(redis, str)
        self.redis: Redis = Redis.from_url(redis) if isinstance(redis, str) else redis
        self.keys = RedisKeys(prefix)
        self.owner = owner
        self.max_queue_len = max_queue_len
        self.poll_interval = poll_interval

    async def enqueue(
        self, request: JobRequest | Mapping[str, Any] | None = None, /, **fields: Any
    ) -> Job:
        """Queue a job: pass a JobRequest, a dict, or its fields as keywords (validated)."""
        return await queue.enqueue(
            self.redis,
            self.keys,
            as_request(request, fields),
            owner=self.owner,
            max_queue_len=self.max_queue_len,
        )

    async def get(self, job_id: str) -> Job:
        return await queue.get_job(self.redis, self.keys, job_id)

    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """The job once terminal, or as it stands after `timeout` seconds."""
        return await queue.wait_job(
            self.redis, self.keys, job_id, timeout=timeout, poll_interval=self.poll_interval
        )

    def stream(self, job_id: str, last_index: int = -1) -> AsyncIterator[TokenChunk]:
        """The job's chunks after `last_index`, each once, in order, until the job ends."""
        return queue.stream_chunks(
            self.redis, self.keys, job_id, last_index=last_index, poll_interval=self.poll_interval
        )

    async def cancel(self, job_id: str) -> Job:
        return await queue.cancel_job(self.redis, self.keys, job_id)

    async def run(
        self,
        request: JobRequest | Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | None = None,
        **fields: Any,
    ) -> Job:
        """Enqueue and wait: the finished job (or the job as it stands after `timeout`)."""
        job = await self.enqueue(request, **fields)
        return await self.wait(job.id, timeout=timeout)

    async def aclose(self) -> None:
        if self._owns_redis:
            await self.redis.aclose()

    async def __aenter__(self) -> AsyncRedisClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class RedisClient:
    """Blocking client for sync code: runs an AsyncRedisClient on a private event-loop thread,
    so it also works inside programs that have their own event loop."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        owner: str | None = None,
        max_queue_len: int | None = None,
        poll_interval: float = queue.DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="inferq-redis-client", daemon=True
        )
        self._thread.start()
        self._client = AsyncRedisClient(
            url,
            prefix=prefix,
            owner=owner,
            max_queue_len=max_queue_len,
            poll_interval=poll_interval,
        )
        self.keys = self._client.keys

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result()

    def enqueue(
        self, request: JobRequest | Mapping[str, Any] | None = None, /, **fields: Any
    ) -> Job:
        return self._call(self._client.enqueue(request, **fields))

    def get(self, job_id: str) -> Job:
        return self._call(self._client.get(job_id))

    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        return self._call(self._client.wait(job_id, timeout=timeout))

    def stream(self, job_id: str, last_index: int = -1) -> Iterator[TokenChunk]:
        chunks = self._client.stream(job_id, last_index)
        try:
            while True:
                try:
                    yield self._call(_next(chunks))
                except StopAsyncIteration:
                    return
        finally:
            self._call(chunks.aclose())

    def cancel(self, job_id: str) -> Job:
        return self._call(self._client.cancel(job_id))

    def run(
        self,
        request: JobRequest | Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | None = None,
        **fields: Any,
    ) -> Job:
        return self._call(self._client.run(request, timeout=timeout, **fields))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> RedisClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
