"""Crash, SIGTERM and a Redis restart with the real engine on the default model (slow): every
job ends with the uninterrupted greedy text and every chunk number delivered exactly once."""

from __future__ import annotations

import asyncio
import signal

import pytest
from real_model_jobs import (
    MODEL,
    enqueue,
    note_prompts,
    reference,
)
from redis.asyncio import Redis
from worker_harness import (
    LiveTap,
    all_have_chunks,
    check_delivery,
    replay_chunks,
    running_worker,
    start_worker_process,
    stop_process,
    stream_all,
    wait_for,
)

from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobStatus

pytestmark = [pytest.mark.anyio, pytest.mark.model, pytest.mark.slow]


async def _finish_elsewhere_and_check(
    redis_url: str,
    smollm,
    jobs,
    streams,
    tap,
    expected,
    *,
    attempts: int,
) -> None:
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client:
        async with running_worker(redis_url, smollm.engine, model=MODEL, name="rescuer"):
            streamed = await asyncio.wait_for(asyncio.gather(*streams), 300)
            done = [await client.wait(job.id, timeout=120) for job in jobs]
        for job, chunks, want in zip(done, streamed, expected, strict=True):
            assert job.status is JobStatus.SUCCEEDED and job.worker == "rescuer"
            assert job.attempts == attempts
            await check_delivery(redis, job, chunks, tap.chunks.get(job.id, []), want)


async def test_sigkill_20_jobs_mid_generation_with_the_real_engine(redis_url, smollm):
    prompts, max_tokens = note_prompts(20), 40
    expected = reference(smollm, prompts, max_tokens)
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client, LiveTap(redis) as tap:
        jobs = await enqueue(client, prompts, max_tokens)
        streams = [asyncio.create_task(stream_all(client, job.id)) for job in jobs]
        doomed = start_worker_process(redis_url, fake=False, model=MODEL, name="doomed")
        try:
            await wait_for(lambda: all_have_chunks(redis, jobs, 4), 300)
        finally:
            doomed.kill()
            doomed.wait()
        assert not await all_have_chunks(redis, jobs, max_tokens)
        await _finish_elsewhere_and_check(
            redis_url, smollm, jobs, streams, tap, expected, attempts=2
        )


async def test_sigterm_with_the_real_engine_exits_0_and_loses_nothing(redis_url, smollm):
    prompts, max_tokens = note_prompts(10), 40
    expected = reference(smollm, prompts, max_tokens)
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client, LiveTap(redis) as tap:
        jobs = await enqueue(client, prompts, max_tokens)
        streams = [asyncio.create_task(stream_all(client, job.id)) for job in jobs]
        leaving = start_worker_process(
            redis_url,
            fake=False,
            model=MODEL,
            name="leaving",
            drain_timeout_s=0.5,
        )
        try:
            await wait_for(lambda: all_have_chunks(redis, jobs, 4), 300)
        finally:
            code = await asyncio.to_thread(stop_process, leaving, signal.SIGTERM, 60)
        assert code == 0, leaving.stdout.read().decode()[-3000:]
        await _finish_elsewhere_and_check(
            redis_url, smollm, jobs, streams, tap, expected, attempts=1
        )


async def test_redis_restart_with_the_real_engine(redis_server, smollm):
    prompts, max_tokens = note_prompts(12), 32
    expected = reference(smollm, prompts, max_tokens)
    url = redis_server.url
    redis = Redis.from_url(url, decode_responses=True)
    async with AsyncRedisClient(url) as client:
        jobs = await enqueue(client, prompts, max_tokens)
        async with running_worker(url, smollm.engine, model=MODEL):
            await wait_for(lambda: all_have_chunks(redis, jobs, 3), 120)
            redis_server.stop()
            await asyncio.sleep(1.5)
            redis_server.start()
            done = [await client.wait(job.id, timeout=120) for job in jobs]
        for job, want in zip(done, expected, strict=True):
            assert job.status is JobStatus.SUCCEEDED
            streamed = [c for _, c in await replay_chunks(redis, job.id)]
            await check_delivery(redis, job, streamed, None, want)
    await redis.aclose()
