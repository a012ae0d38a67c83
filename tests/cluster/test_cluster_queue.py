"""The queue on a 3-primary Redis Cluster with replicas (real redis-server processes): a
worker on the fake engine and the Redis client, both in cluster mode."""

from __future__ import annotations

import asyncio

import pytest
from cluster_helpers import MODEL, cluster_settings, collect, replay
from worker_fakes import FakeEngine, expected_output
from worker_harness import running_worker

from producer_api.client.redis_client import AsyncRedisClient
from redis_io.clients import redis_client
from schemas import JobStatus

pytestmark = pytest.mark.anyio


async def test_jobs_stream_and_finish_on_every_shard(cluster_url, redis_cluster):
    settings = cluster_settings(cluster_url)
    async with (
        AsyncRedisClient(settings) as client,
        running_worker(cluster_url, FakeEngine(), model=MODEL, redis_cluster=True),
    ):
        keys = client.keys
        jobs = [
            await client.enqueue(
                model=MODEL,
                prompt_token_ids=[11 + i] * (3 + i % 4),
                stream=True,
                sampling={"max_tokens": 4 + i % 3},
            )
            for i in range(12)
        ]
        # the jobs' own keys sit on more than one primary, and the queue's partitions too
        assert len({redis_cluster.primary_of(keys.job(job.id)).port for job in jobs}) > 1
        partitions = {keys.queue_stream(MODEL, 0, job.id) for job in jobs}
        assert len({redis_cluster.primary_of(p).port for p in partitions}) > 1
        streamed = await asyncio.gather(
            *[asyncio.wait_for(collect(client, job.id), 30) for job in jobs]
        )
        for job, chunks in zip(jobs, streamed, strict=True):
            done = await client.wait(job.id, timeout=20)
            assert done.status is JobStatus.SUCCEEDED, done
            ids, text = expected_output(
                job.request.prompt_token_ids, job.request.sampling.max_tokens
            )
            assert (done.result.choices[0].token_ids, done.result.choices[0].text) == (ids, text)
            assert [c.index for c in chunks] == list(range(len(ids)))
            assert [t for c in chunks for t in c.token_ids] == ids
            assert await replay(client, job.id) == chunks
            assert done.attempts == 1
        # every entry acked and deleted: the backlog is empty on every partition
        assert await client.redis.xlen(keys.jobs_stream(MODEL, 0)) == 0
        for stream in keys.jobs_streams(MODEL):
            assert await client.redis.xlen(stream) == 0


async def test_a_live_subscriber_hears_chunks_on_the_jobs_shard(cluster_url):
    # The waiting call subscribes (sharded) before the job runs, and returns on the final chunk.
    settings = cluster_settings(cluster_url)
    engine = FakeEngine(step_seconds=0.05)
    async with (
        AsyncRedisClient(settings) as client,
        running_worker(cluster_url, engine, model=MODEL, redis_cluster=True),
    ):
        job = await client.enqueue(
            model=MODEL, prompt_token_ids=[5, 6, 7], stream=True, sampling={"max_tokens": 6}
        )
        chunks = await asyncio.wait_for(collect(client, job.id), 30)
        assert "".join(c.text for c in chunks) == expected_output([5, 6, 7], 6)[1]


def test_the_cluster_client_is_picked_by_the_setting(cluster_url):
    assert type(redis_client(cluster_settings(cluster_url))).__name__ == "RedisCluster"
