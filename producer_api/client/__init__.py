"""Python clients for backend apps: one interface over HTTP (the API) or straight over Redis.

    from producer_api.client import AsyncClient, Client

    with Client("http://127.0.0.1:8000", api_key="...") as client:     # or "redis://host:6379/0"
        job = client.enqueue(model="SmolLM2-135M-Instruct", prompt="Hi", stream=True)
        for chunk in client.stream(job.id):                             # resumes after drops
            print(chunk.text, end="")
        print(client.wait(job.id).result.usage)

    async with AsyncClient("redis://127.0.0.1:6379/0") as client:
        job = await client.run(model="SmolLM2-135M-Instruct", prompt="Hi", timeout=60)

    # Redis behind Sentinels (follows failovers; waits for a replica to hold each job):
    where = RedisConnectionSettings(redis_sentinels="s1:26379,s2:26379,s3:26379",
                                    redis_master_name="inferq", redis_wait_replicas=1)
    async with AsyncClient(where) as client: ...

The transport follows the URL's scheme (http/https or redis/rediss/unix) unless `transport`
says otherwise. Methods: enqueue, get, wait, stream, cancel, run, and embed (texts -> vectors
of an embedding model, up to 2,048 inputs a job); errors are
`producer_api.queue.QueueError` (`JobNotFoundError` for an unknown job) on both transports.
`Client` runs an `AsyncClient` on a private event-loop thread, so it works inside a running
event loop too.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal, TypedDict, Unpack
from urllib.parse import urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer_api.client.base import AsyncJobClient
from producer_api.client.blocking import BlockingClient
from producer_api.client.http_client import (
    DEFAULT_BASE_URL,
    AsyncHttpClient,
    HttpError,
    ServiceUnavailable,
)
from producer_api.client.redis_client import AsyncRedisClient, RedisClient
from producer_api.client.resume import DEFAULT_MAX_RETRIES, resuming_stream, retrying
from producer_api.queue import DEFAULT_POLL_INTERVAL_S, JobNotFoundError, QueueError
from schemas import DEFAULT_PREFIX, Job, JobRequest, TokenChunk
from schemas.redis_connection import RedisConnectionSettings

Transport = Literal["http", "redis"]
_REDIS_RETRY_ON = (RedisConnectionError, RedisTimeoutError, ConnectionError)
_SCHEMES: dict[str, Transport] = {
    "http": "http",
    "https": "http",
    "redis": "redis",
    "rediss": "redis",
    "unix": "redis",
}


def transport_of(url: str) -> Transport:
    scheme = urlsplit(url).scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"cannot tell the transport of {url!r}: use http(s):// or redis://")
    return _SCHEMES[scheme]


class AsyncClient(AsyncJobClient):
    """asyncio client over HTTP or Redis (see the module docstring)."""

    def __init__(
        self,
        url: str | RedisConnectionSettings = DEFAULT_BASE_URL,
        *,
        transport: Transport | None = None,
        api_key: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        owner: str | None = None,
        timeout: float = 30.0,
        max_retries: int = DEFAULT_MAX_RETRIES,
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        self.transport: Transport = (
            "redis" if isinstance(url, RedisConnectionSettings) else transport or transport_of(url)
        )
        self.max_retries = max_retries
        self._impl: AsyncJobClient
        if self.transport == "http" and isinstance(url, str):
            self._impl = AsyncHttpClient(
                url, api_key=api_key, timeout=timeout, max_retries=max_retries
            )
        else:
            self._impl = AsyncRedisClient(
                url, prefix=prefix, owner=owner, poll_interval=poll_interval
            )

    async def enqueue(
        self, request: JobRequest | Mapping[str, Any] | None = None, /, **fields: Any
    ) -> Job:
        return await self._impl.enqueue(request, **fields)

    async def get(self, job_id: str) -> Job:
        impl = self._impl
        if isinstance(impl, AsyncHttpClient):  # it retries by itself
            return await impl.get(job_id)
        return await retrying(lambda: impl.get(job_id), _REDIS_RETRY_ON, self.max_retries)

    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """The job once terminal (or as it is after `timeout` s); over Redis a failover or a
        dropped connection is waited out within the same timeout."""
        impl = self._impl
        if isinstance(impl, AsyncHttpClient):
            return await impl.wait(job_id, timeout=timeout)
        give_up = None if timeout is None else time.monotonic() + timeout

        async def wait_left() -> Job:
            left = None if give_up is None else max(give_up - time.monotonic(), 0.0)
            return await impl.wait(job_id, timeout=left)

        return await retrying(wait_left, _REDIS_RETRY_ON, self.max_retries)

    def stream(self, job_id: str, last_index: int = -1) -> AsyncIterator[TokenChunk]:
        """Chunks after `last_index`, each once and in order, reconnecting after drops."""
        impl = self._impl
        if isinstance(impl, AsyncHttpClient):  # it reconnects by itself
            return impl.stream(job_id, last_index)
        return resuming_stream(
            lambda after: impl.stream(job_id, after), last_index, _REDIS_RETRY_ON, self.max_retries
        )

    async def cancel(self, job_id: str) -> Job:
        return await self._impl.cancel(job_id)

    async def aclose(self) -> None:
        await self._impl.aclose()


class ClientOptions(TypedDict, total=False):
    transport: Transport | None
    api_key: str | None
    prefix: str
    owner: str | None
    timeout: float
    max_retries: int
    poll_interval: float


class Client(BlockingClient[AsyncClient]):
    """Blocking client over HTTP or Redis: AsyncClient's methods and options, for sync code."""

    def __init__(
        self,
        url: str | RedisConnectionSettings = DEFAULT_BASE_URL,
        **options: Unpack[ClientOptions],
    ) -> None:
        super().__init__(AsyncClient(url, **options))
        self.transport: Transport = self.async_client.transport
        self.max_retries = self.async_client.max_retries


__all__ = [
    "AsyncClient",
    "AsyncHttpClient",
    "AsyncRedisClient",
    "Client",
    "ClientOptions",
    "HttpError",
    "JobNotFoundError",
    "QueueError",
    "RedisClient",
    "RedisConnectionSettings",
    "ServiceUnavailable",
    "Transport",
    "transport_of",
]
