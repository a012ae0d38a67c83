"""Workers that die, stop or lose Redis: no job lost, no chunk doubled or skipped (fake engine).

The worker under test runs as a real subprocess where it is killed or signalled."""

from __future__ import annotations

import asyncio
import signal

import pytest
from redis.asyncio import Redis
from worker_fakes import FakeEngine, expected_output
from worker_harness import (
    KEYS,
    LiveTap,
    all_have_chunks,
    check_delivery,
    enqueue_token_jobs,
    replay_chunks,
    running_worker,
    start_slow_fake_worker,
    stop_process,
    stream_all,
    wait_for,
)

from producer_api.client.redis_client import AsyncRedisClient
from schemas import Job, JobStatus

pytestmark = pytest.mark.anyio
MODEL = "fake-model"


def _expected(job: Job) -> tuple[list[int], str]:
    return expected_output(job.request.prompt_token_ids, job.request.sampling.max_tokens)


async def test_sigkill_mid_generation_another_worker_resumes_every_job(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client, LiveTap(redis) as tap:
        jobs = await enqueue_token_jobs(client, MODEL, 20, max_tokens=40, first_token=70)
        streams = [asyncio.create_task(stream_all(client, job.id)) for job in jobs]
        first = start_slow_fake_worker(redis_url, MODEL, "doomed")
        try:
            await wait_for(lambda: all_have_chunks(redis, jobs, 5), 60)
        finally:
            first.kill()
            first.wait()
        assert not await all_have_chunks(redis, jobs, 40)  # killed mid-generation
        async with running_worker(redis_url, FakeEngine(), model=MODEL, name="rescuer") as rescuer:
            streamed = await asyncio.wait_for(asyncio.gather(*streams), 60)
            done = [await client.wait(job.id, timeout=30) for job in jobs]
        assert rescuer.outcomes["succeeded"] == 20
        for job, chunks in zip(done, streamed, strict=True):
            assert job.status is JobStatus.SUCCEEDED and job.worker == "rescuer"
            assert job.attempts == 2
            await check_delivery(redis, job, chunks, tap.chunks.get(job.id, []), _expected(job))


async def test_sigterm_exits_0_and_hands_unfinished_jobs_to_another_worker(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client, LiveTap(redis) as tap:
        jobs = await enqueue_token_jobs(client, MODEL, 12, max_tokens=60, first_token=70)
        streams = [asyncio.create_task(stream_all(client, job.id)) for job in jobs]
        leaving = start_slow_fake_worker(redis_url, MODEL, "leaving", drain_timeout_s=0.3)
        try:
            await wait_for(lambda: all_have_chunks(redis, jobs, 5), 60)
        finally:
            code = await asyncio.to_thread(stop_process, leaving, signal.SIGTERM, 30)
        assert code == 0, leaving.stdout.read().decode()
        # Handed back at once: re-queued with fresh entries, nothing left pending.
        assert await redis.xlen(KEYS.jobs_stream(MODEL)) == 12
        assert (await redis.xpending(KEYS.jobs_stream(MODEL), "workers"))["pending"] == 0
        async with running_worker(
            redis_url, FakeEngine(), model=MODEL, name="heir", claim_min_idle_ms=60_000
        ):
            streamed = await asyncio.wait_for(asyncio.gather(*streams), 30)
            done = [await client.wait(job.id, timeout=30) for job in jobs]
        for job, chunks in zip(done, streamed, strict=True):
            assert job.status is JobStatus.SUCCEEDED and job.worker == "heir"
            assert job.attempts == 1  # a graceful hand-back is no failed attempt
            await check_delivery(redis, job, chunks, tap.chunks.get(job.id, []), _expected(job))


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_redis_restart_mid_run_every_job_finishes(redis_server, how):
    url = redis_server.url
    engine = FakeEngine(step_seconds=0.03)
    async with AsyncRedisClient(url) as client:
        jobs = await enqueue_token_jobs(client, MODEL, 16, max_tokens=50, first_token=70)
        redis = Redis.from_url(url, decode_responses=True)
        async with running_worker(url, engine, model=MODEL) as worker:
            await wait_for(lambda: all_have_chunks(redis, jobs, 3), 30)
            getattr(redis_server, how)()
            steps_when_down = engine.steps
            await asyncio.sleep(1.0)
            assert engine.steps > steps_when_down  # the engine kept generating meanwhile
            redis_server.start()
            done = [await client.wait(job.id, timeout=30) for job in jobs]
            assert worker.outcomes["succeeded"] == 16
        for job in done:
            assert job.status is JobStatus.SUCCEEDED
            streamed = [c for _, c in await replay_chunks(redis, job.id)]
            await check_delivery(redis, job, streamed, None, _expected(job))
        await redis.aclose()


async def test_sigterm_lets_running_jobs_finish_within_the_drain_timeout(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client:
        jobs = await enqueue_token_jobs(client, MODEL, 6, max_tokens=30, first_token=70)
        drainer = start_slow_fake_worker(redis_url, MODEL, "drainer", drain_timeout_s=30)
        try:
            await wait_for(lambda: all_have_chunks(redis, jobs, 3), 30)
            drainer.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            more = await enqueue_token_jobs(
                client, MODEL, 2, max_tokens=5, first_token=70
            )  # after the signal: not pulled
            code = await asyncio.to_thread(drainer.wait, 30)
        finally:
            if drainer.poll() is None:
                drainer.kill()
                drainer.wait()
        assert code == 0
        for job in jobs:
            done = await client.get(job.id)
            assert done.status is JobStatus.SUCCEEDED and done.worker == "drainer"
        assert await redis.xlen(KEYS.jobs_stream(MODEL)) == len(more)
