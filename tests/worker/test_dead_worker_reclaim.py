"""A dead worker's jobs move as soon as its heartbeat says it died, not when their lease runs
out; a live worker's jobs never move (fake engine, real worker processes where one is killed)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis
from worker_fakes import FakeEngine, expected_output
from worker_harness import (
    KEYS,
    LiveTap,
    all_have_chunks,
    check_delivery,
    enqueue_token_jobs,
    running_worker,
    start_slow_fake_worker,
    stop_process,
    stream_all,
    wait_for,
)

from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobStatus

pytestmark = pytest.mark.anyio
MODEL = "fake-model"
LEASE_MS = 120_000  # far longer than any wait below: only the heartbeat can move a job
HEARTBEAT = dict(heartbeat_interval_s=0.2, heartbeat_ttl_s=1, claim_min_idle_ms=LEASE_MS)


async def _consumer_gone(redis: Redis, name: str) -> bool:
    consumers = await redis.xinfo_consumers(KEYS.jobs_stream(MODEL), KEYS.group)
    return name not in {consumer["name"] for consumer in consumers}


async def test_a_killed_workers_jobs_move_once_its_heartbeat_expires(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client, LiveTap(redis) as tap:
        jobs = await enqueue_token_jobs(client, MODEL, 8, max_tokens=40, first_token=90)
        streams = [asyncio.create_task(stream_all(client, job.id)) for job in jobs]
        doomed = start_slow_fake_worker(redis_url, MODEL, "doomed", **HEARTBEAT)
        try:
            await wait_for(lambda: all_have_chunks(redis, jobs, 3), 60)
        finally:
            doomed.kill()
            doomed.wait()
        killed_at = time.monotonic()
        async with running_worker(
            redis_url, FakeEngine(), model=MODEL, name="heir", **HEARTBEAT
        ) as heir:
            streamed = await asyncio.wait_for(asyncio.gather(*streams), 60)
            done = [await client.wait(job.id, timeout=30) for job in jobs]
            moved_after_s = time.monotonic() - killed_at
            # the dead consumer, holding nothing any more, leaves the group
            await wait_for(lambda: _consumer_gone(redis, "doomed"), 10)
        assert heir.outcomes["succeeded"] == 8
        # heartbeat TTL 1 s, checks every beat: seconds, against a lease of two minutes (the
        # bound leaves room for a loaded machine)
        assert moved_after_s < 40, f"the jobs finished {moved_after_s:.1f} s after the kill"
        for job, chunks in zip(done, streamed, strict=True):
            assert job.status is JobStatus.SUCCEEDED and job.worker == "heir"
            expected = expected_output(
                job.request.prompt_token_ids, job.request.sampling.max_tokens
            )
            await check_delivery(redis, job, chunks, tap.chunks.get(job.id, []), expected)
        await redis.aclose()


async def test_a_live_workers_jobs_stay_with_it(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client:
        jobs = await enqueue_token_jobs(client, MODEL, 6, max_tokens=60, first_token=90)
        slow = start_slow_fake_worker(redis_url, MODEL, "slow", **HEARTBEAT)
        try:
            await wait_for(lambda: all_have_chunks(redis, jobs, 2), 60)
            async with running_worker(
                redis_url, FakeEngine(), model=MODEL, name="idle", **HEARTBEAT
            ) as idle:
                done = [await client.wait(job.id, timeout=60) for job in jobs]
                assert idle.outcomes.get("succeeded", 0) == 0
        finally:
            stop_process(slow)
        for job in done:
            assert job.status is JobStatus.SUCCEEDED and job.worker == "slow"
            assert job.attempts == 1
        await redis.aclose()
