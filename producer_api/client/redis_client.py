"""A small client that talks to Redis directly: enqueue, get, wait, stream, cancel.

    async with AsyncRedisClient("redis://localhost:6379/0") as client:   # or Sentinels:
    # AsyncRedisClient(RedisConnectionSettings(redis_sentinels="s1:26379,s2:26379",
    #                                          redis_master_name="inferq", redis_wait_replicas=1))
        job = await client.enqueue(model="SmolLM2-135M-Instruct", prompt="Hi", stream=True)
        async for chunk in client.stream(job.id):
            print(chunk.text, end="")

    with RedisClient("redis://localhost:6379/0") as client:   # the same, for sync code
        job = client.run(model="SmolLM2-135M-Instruct", prompt="Hi", timeout=60)
        print(job.result.choices[0].text)

Both are thin wrappers over `producer_api.queue`, the functions the HTTP API uses too; the
blocking one runs the async one on a private event-loop thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, TypedDict, Unpack

from redis.asyncio import Redis

from producer_api import queue
from producer_api.client.base import AsyncJobClient, as_request
from producer_api.client.blocking import BlockingClient
from redis_io.clients import is_cluster, redis_client
from schemas import DEFAULT_PREFIX, Job, JobRequest, RedisKeys, TokenChunk
from schemas.redis_connection import RedisConnectionSettings, ReplicaWait

DEFAULT_URL = "redis://localhost:6379/0"


class AsyncRedisClient(AsyncJobClient):
    """asyncio client. Give it a URL or `RedisConnectionSettings` (Sentinels, replicas to wait
    for; it then owns the connection pool), or a `redis.asyncio.Redis`."""

    def __init__(
        self,
        redis: Redis | str | RedisConnectionSettings = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        owner: str | None = None,
        max_queue_len: int | None = None,
        poll_interval: float = queue.DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        self._owns_redis = isinstance(redis, str | RedisConnectionSettings)
        if isinstance(redis, str):
            redis = RedisConnectionSettings(redis_url=redis)
        self.replicas: ReplicaWait | None = None
        if isinstance(redis, RedisConnectionSettings):
            self.replicas = redis.replica_wait()
            self.keys = redis.redis_keys(prefix)
            redis = redis_client(redis, decode_responses=False)
        elif is_cluster(redis):  # a cluster client of the caller's: the cluster defaults
            self.keys = RedisConnectionSettings(redis_cluster=True).redis_keys(prefix)
        else:
            self.keys = RedisKeys(prefix)
        self.redis: Redis = redis
        self.owner = owner
        self.max_queue_len = max_queue_len
        self.poll_interval = poll_interval

    async def enqueue(
        self, request: JobRequest | Mapping[str, Any] | None = None, /, **fields: Any
    ) -> Job:
        return await queue.enqueue(
            self.redis,
            self.keys,
            as_request(request, fields),
            owner=self.owner,
            max_queue_len=self.max_queue_len,
            replicas=self.replicas,
        )

    async def get(self, job_id: str) -> Job:
        return await queue.get_job(self.redis, self.keys, job_id)

    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        return await queue.wait_job(
            self.redis, self.keys, job_id, timeout=timeout, poll_interval=self.poll_interval
        )

    def stream(self, job_id: str, last_index: int = -1) -> AsyncIterator[TokenChunk]:
        return queue.stream_chunks(
            self.redis, self.keys, job_id, last_index=last_index, poll_interval=self.poll_interval
        )

    async def cancel(self, job_id: str) -> Job:
        return await queue.cancel_job(self.redis, self.keys, job_id)

    async def aclose(self) -> None:
        if self._owns_redis:
            await self.redis.aclose()


class RedisOptions(TypedDict, total=False):
    prefix: str
    owner: str | None
    max_queue_len: int | None
    poll_interval: float


class RedisClient(BlockingClient[AsyncRedisClient]):
    """AsyncRedisClient for sync code (see `BlockingClient`)."""

    def __init__(
        self, url: str | RedisConnectionSettings = DEFAULT_URL, **options: Unpack[RedisOptions]
    ) -> None:
        super().__init__(AsyncRedisClient(url, **options))
        self.keys = self.async_client.keys
