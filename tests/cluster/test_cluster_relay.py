"""The relay's saving on a 3-primary Redis Cluster: no SPUBLISH for a job nobody subscribes to
(the worker asks the job's own shard, `PUBSUB SHARDNUMSUB`), yet a sharded subscriber that joins
mid-job gets every chunk exactly once."""

from __future__ import annotations

import pytest
from cluster_helpers import cluster_redis, replay
from redis.asyncio import Redis

from producer_api.client.redis_client import AsyncRedisClient
from redis_io.pubsub import job_pubsub
from schemas import JobStatus, TokenChunk
from schemas.jobs import new_job_id
from schemas.redis_connection import RedisConnectionSettings
from worker.publisher import Outbox

pytestmark = pytest.mark.anyio


def _chunk(job_id: str, index: int, final: bool = False) -> TokenChunk:
    return TokenChunk(
        job_id=job_id,
        index=index,
        text=f" t{index}",
        token_ids=[index],
        finish_reason="length" if final else None,
        final=final,
    )


async def _spublished(port: int) -> int:
    node = Redis(port=port, decode_responses=True)
    try:
        return int((await node.info("commandstats")).get("cmdstat_spublish", {}).get("calls", 0))
    finally:
        await node.aclose()


async def test_unheard_jobs_are_not_published_and_a_late_subscriber_misses_nothing(
    cluster_url, redis_cluster
):
    redis = cluster_redis(cluster_url)
    keys = RedisConnectionSettings(redis_cluster=True).redis_keys("inferq")
    job = new_job_id()
    outbox = Outbox(keys, keys.jobs_stream("m"), "w")
    await redis.hset(keys.job(job), "status", JobStatus.RUNNING.value)
    shard = redis_cluster.primary_of(keys.channel(job)).port
    before = await _spublished(shard)
    for index in range(3):  # nobody listens: only the first chunk (before any look) goes live
        outbox.chunk(_chunk(job, index))
        await outbox.flush(redis)
    assert await _spublished(shard) - before == 1
    assert not outbox.listeners.publishes(job)

    pubsub = await job_pubsub(redis, keys.channel(job))
    await pubsub.subscribe(keys.channel(job))
    await pubsub.get_message(timeout=1)
    outbox.chunk(_chunk(job, 3))  # written unpublished: the look after it finds the subscriber
    await outbox.flush(redis)
    assert outbox.listeners.publishes(job)
    outbox.chunk(_chunk(job, 4, final=True))  # the catch-up of 3 goes first
    await outbox.flush(redis)
    heard = []
    while message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5):
        heard.append(TokenChunk.from_json(message["data"]).index)
    assert heard == [3, 4]
    await pubsub.aclose()
    async with AsyncRedisClient(redis) as client:
        assert [c.index for c in await replay(client, job)] == [0, 1, 2, 3, 4]
    await redis.aclose()
