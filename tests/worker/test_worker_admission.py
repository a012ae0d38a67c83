"""Pull by free KV blocks: a worker never hoards jobs, and workers share by capacity."""

from __future__ import annotations

import asyncio
import math

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from worker_fakes import FakeEngine
from worker_harness import KEYS, running_worker

from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobStatus

pytestmark = pytest.mark.anyio
MODEL = "fake-model"


async def _pending_of(redis: Redis, consumer: str) -> int:
    try:
        consumers = await redis.xinfo_consumers(KEYS.jobs_stream(MODEL), "workers")
    except ResponseError:  # no group yet: the worker is starting
        return 0
    return next((c["pending"] for c in consumers if c["name"] == consumer), 0)


async def test_pending_entries_stay_within_what_free_blocks_admit(redis_url):
    blocks, prompt_len, max_tokens = 48, 40, 24
    engine = FakeEngine(num_kv_blocks=blocks, step_seconds=0.01)
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client:
        jobs = [
            await client.enqueue(
                model=MODEL,
                prompt_token_ids=[50 + i] * prompt_len,
                sampling={"max_tokens": max_tokens},
            )
            for i in range(60)
        ]
        samples: list[tuple[int, int]] = []
        async with running_worker(redis_url, engine, model=MODEL, name="solo") as worker:
            while True:
                samples.append((await _pending_of(redis, "solo"), engine.stats().num_running))
                if worker.outcomes.get("succeeded", 0) == len(jobs):
                    break
                await asyncio.sleep(0.005)
        statuses = {(await client.get(j.id)).status for j in jobs}
        assert statuses == {JobStatus.SUCCEEDED}
    # At most what the cache can run at once (each job needs 3 blocks to start) plus one pull
    # (the engine charges 5 blocks per admitted job: prompt + a block of output + a reserve).
    can_run = blocks // math.ceil((prompt_len + 1) / engine.block_size)
    one_pull = blocks // (math.ceil((prompt_len + engine.block_size) / engine.block_size) + 1)
    most_pending = max(pending for pending, _ in samples)
    assert most_pending <= can_run + one_pull < len(jobs)
    assert max(running for _, running in samples) > one_pull  # it did fill the cache


async def test_two_workers_share_a_backlog_by_capacity(redis_url):
    small = FakeEngine(num_kv_blocks=32, step_seconds=0.02)
    big = FakeEngine(num_kv_blocks=128, step_seconds=0.02)
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client:
        jobs = [
            await client.enqueue(
                model=MODEL, prompt_token_ids=[60 + i] * 30, sampling={"max_tokens": 12}
            )
            for i in range(90)
        ]
        async with (
            running_worker(redis_url, small, model=MODEL, name="small"),
            running_worker(redis_url, big, model=MODEL, name="big"),
        ):
            done = [await client.wait(job.id, timeout=60) for job in jobs]
    assert all(job.status is JobStatus.SUCCEEDED for job in done)
    by_worker = {"small": 0, "big": 0}
    for job in done:
        by_worker[job.worker] += 1
    # 4x the cache: expect about 4/5 of the jobs on the big worker.
    assert by_worker["big"] >= 2.5 * by_worker["small"], by_worker
    assert by_worker["small"] > 0, by_worker
    assert await redis.xlen(KEYS.jobs_stream(MODEL)) == 0
