"""Helpers for the cluster tests: settings and clients in cluster mode, and what a streaming
client must have seen of a job."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from worker_fakes import expected_output
from worker_harness import start_slow_fake_worker, wait_for

from producer_api.client.redis_client import AsyncRedisClient
from redis_io.clients import redis_client
from schemas import Job, TokenChunk
from schemas.chunks import REPLAY_FIELD
from schemas.redis_connection import RedisConnectionSettings

MODEL = "fake-model"


def cluster_settings(url: str) -> RedisConnectionSettings:
    return RedisConnectionSettings(redis_url=url, redis_cluster=True)


def cluster_redis(url: str) -> Redis:
    return redis_client(cluster_settings(url))


async def replay(client: AsyncRedisClient, job_id: str) -> list[TokenChunk]:
    entries = await client.redis.xrange(client.keys.out_stream(job_id), "-", "+")
    out = []
    for _, fields in entries:
        raw = fields.get(REPLAY_FIELD, fields.get(REPLAY_FIELD.encode()))
        out.append(TokenChunk.from_json(raw))
    return out


async def collect(client: AsyncRedisClient, job_id: str) -> list[TokenChunk]:
    return [chunk async for chunk in client.stream(job_id)]


async def enqueue_many(client: AsyncRedisClient, count: int, max_tokens: int) -> list[Job]:
    return [
        await client.enqueue(
            model=MODEL,
            prompt_token_ids=[70 + i, 71, 72],
            stream=True,
            sampling={"max_tokens": max_tokens},
        )
        for i in range(count)
    ]


async def check_exactly_once(
    client: AsyncRedisClient, job: Job, streamed: list[TokenChunk]
) -> None:
    """The stream numbered 0..n-1 once each, the uninterrupted text, the replay stream the same
    chunks, and the stored result that text."""
    ids, text = expected_output(job.request.prompt_token_ids, job.request.sampling.max_tokens)
    assert [c.index for c in streamed] == list(range(len(streamed)))
    assert [t for c in streamed for t in c.token_ids] == ids
    assert "".join(c.text for c in streamed) == text
    assert streamed[-1].final and not any(c.final for c in streamed[:-1])
    assert await replay(client, job.id) == streamed
    choice = job.result.choices[0]
    assert (choice.token_ids, choice.text) == (ids, text)


async def chunks_at_least(client: AsyncRedisClient, jobs: list[Job], count: int) -> bool:
    for job in jobs:
        if await client.redis.xlen(client.keys.out_stream(job.id)) < count:
            return False
    return True


async def kill_a_worker_once(url: str, started: Callable[[], Awaitable[bool]]) -> None:
    """Run a slow fake worker ("doomed") on the cluster until `started`, then SIGKILL it."""
    doomed = start_slow_fake_worker(url, MODEL, "doomed", redis_cluster=True)
    try:
        await wait_for(started, 60)
    finally:
        doomed.kill()
        doomed.wait()
