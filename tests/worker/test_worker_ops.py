"""Operations: metrics endpoint, losing a lease, a restarted worker reclaiming its own entries."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from redis.asyncio import Redis
from worker_fakes import FakeEngine
from worker_harness import KEYS, running_worker, start_slow_fake_worker, wait_for

from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobStatus

pytestmark = pytest.mark.anyio
MODEL = "fake-model"


async def test_prometheus_metrics_are_served(redis_url):
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(
            redis_url, FakeEngine(), model=MODEL, metrics_port=0, metrics_host="127.0.0.1"
        ) as worker,
    ):
        job = await client.enqueue(
            model=MODEL, prompt_token_ids=[21, 22], sampling={"max_tokens": 5}
        )
        assert (await client.wait(job.id, timeout=10)).status is JobStatus.SUCCEEDED
        await wait_for(lambda: worker.metrics_port, 5)
        url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
        text = (
            await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        ).decode()
    assert f'inferq_worker_requests_total{{model="{MODEL}",outcome="succeeded"}} 1.0' in text
    assert f'inferq_worker_generation_tokens_total{{model="{MODEL}"}} 5.0' in text
    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "queue_wait_seconds",
        "step_seconds",
        "kv_cache_usage",
        "prefix_cache_hit_rate",
        "running",
        "waiting",
    ):
        assert f"inferq_worker_{name}" in text


async def test_a_worker_that_lost_its_lease_stops_the_job(redis_url):
    engine = FakeEngine(step_seconds=0.02)
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(
            redis_url, engine, model=MODEL, name="slowpoke", claim_min_idle_ms=600
        ) as worker,
    ):
        job = await client.enqueue(
            model=MODEL, prompt_token_ids=[23] * 4, stream=True, sampling={"max_tokens": 2000}
        )
        await wait_for(lambda: engine.stats().num_running == 1, 10)
        entry = (await client.get(job.id)).entry_id
        # another worker took the entry over (as a janitor would after a missed renewal)
        await redis.xclaim(KEYS.jobs_stream(MODEL), "workers", "thief", 0, [entry], justid=True)
        await wait_for(lambda: worker.outcomes.get("lost") == 1, 5)
        assert engine.stats().num_running == 0 and not engine.has_unfinished()
        consumers = await redis.xinfo_consumers(KEYS.jobs_stream(MODEL), "workers")
        assert {c["name"]: c["pending"] for c in consumers}["thief"] == 1  # left to its new owner


async def test_a_restarted_worker_resumes_its_own_pending_jobs_at_once(redis_url):
    async with AsyncRedisClient(redis_url) as client:
        jobs = [
            await client.enqueue(
                model=MODEL, prompt_token_ids=[24 + i], stream=True, sampling={"max_tokens": 60}
            )
            for i in range(4)
        ]
        first = start_slow_fake_worker(redis_url, MODEL, "phoenix")
        redis = Redis.from_url(redis_url, decode_responses=True)

        async def started() -> bool:
            return all([await redis.xlen(KEYS.out_stream(j.id)) >= 3 for j in jobs])

        try:
            await wait_for(started, 30)
        finally:
            first.kill()
            first.wait()
        # Same name, a lease far longer than the test: only its own pending list can bring them back.
        async with running_worker(
            redis_url, FakeEngine(), model=MODEL, name="phoenix", claim_min_idle_ms=600_000
        ):
            done = [await client.wait(job.id, timeout=10) for job in jobs]
    assert all(job.status is JobStatus.SUCCEEDED and job.attempts == 2 for job in done)


async def test_a_worker_recreates_its_group_after_redis_lost_everything(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, FakeEngine(), model=MODEL),
    ):
        first = await client.enqueue(model=MODEL, prompt_token_ids=[25], sampling={"max_tokens": 2})
        assert (await client.wait(first.id, timeout=10)).status is JobStatus.SUCCEEDED
        await redis.flushall()  # e.g. a restart without persistence
        job = await client.enqueue(model=MODEL, prompt_token_ids=[26], sampling={"max_tokens": 2})
        assert (await client.wait(job.id, timeout=10)).status is JobStatus.SUCCEEDED
