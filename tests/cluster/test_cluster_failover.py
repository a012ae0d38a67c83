"""A shard's primary SIGKILLed while 40 jobs stream: its replica takes over, and every job
finishes exactly once, its stream numbered without a gap or a repeat."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from cluster_helpers import (
    MODEL,
    check_exactly_once,
    chunks_at_least,
    cluster_settings,
    enqueue_many,
)
from worker_fakes import FakeEngine
from worker_harness import running_worker, wait_for

from producer_api.client.redis_client import AsyncRedisClient
from producer_api.queue import REDIS_UNAVAILABLE
from schemas import JobStatus, TokenChunk

pytestmark = pytest.mark.anyio
JOBS = 40
TOKENS = 60


async def resumed_stream(client: AsyncRedisClient, job_id: str) -> list[TokenChunk]:
    """What a streaming client sees that reconnects after an error, from its last chunk (the
    documented resume: `stream(job_id, last_index)`)."""
    chunks: list[TokenChunk] = []
    while True:
        try:
            async for chunk in client.stream(job_id, last_index=chunks[-1].index if chunks else -1):
                chunks.append(chunk)
            return chunks
        except REDIS_UNAVAILABLE:
            await asyncio.sleep(0.2)


async def test_a_primary_killed_under_40_streaming_jobs(private_redis_cluster):
    cluster = private_redis_cluster
    url = cluster.url
    engine = FakeEngine(step_seconds=0.05)
    async with (
        AsyncRedisClient(cluster_settings(url)) as client,
        running_worker(url, engine, model=MODEL, redis_cluster=True) as worker,
    ):
        jobs = await enqueue_many(client, JOBS, max_tokens=TOKENS)
        streams = [asyncio.create_task(resumed_stream(client, job.id)) for job in jobs]
        await wait_for(lambda: chunks_at_least(client, jobs, 3), 60)
        # the primary holding most of the jobs' own keys
        holders = Counter(cluster.primary_of(client.keys.job(job.id)).port for job in jobs)
        port, held = holders.most_common(1)[0]
        victim = next(node for node in cluster.nodes if node.port == port)
        assert held >= JOBS // 3
        on_victim = next(j for j in jobs if cluster.primary_of(client.keys.job(j.id)) is victim)
        assert not await chunks_at_least(client, jobs, TOKENS)  # mid-generation
        victim.kill()
        streamed = await asyncio.wait_for(asyncio.gather(*streams), 120)
        done = [await _wait(client, job.id) for job in jobs]
        assert worker.outcomes["succeeded"] == JOBS
    assert not victim.running
    assert cluster.primary_of(client.keys.job(on_victim.id)).running  # its replica took over
    for job, chunks in zip(done, streamed, strict=True):
        assert job.status is JobStatus.SUCCEEDED, job
        await check_exactly_once_after(cluster.url, job, chunks)  # a node alive now


async def _wait(client: AsyncRedisClient, job_id: str):
    while True:
        try:
            return await client.wait(job_id, timeout=60)
        except REDIS_UNAVAILABLE:
            await asyncio.sleep(0.2)


async def check_exactly_once_after(url: str, job, chunks) -> None:
    async with AsyncRedisClient(cluster_settings(url)) as client:
        await check_exactly_once(client, job, chunks)
