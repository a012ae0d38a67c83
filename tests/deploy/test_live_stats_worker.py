"""A worker's heartbeat carries the live stats the dashboard reads: the TTFT of every job it
finished (the same value as the job's result) and its cumulative token counts."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from worker_fakes import FakeEngine
from worker_harness import KEYS, running_worker, wait_for

from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobStatus
from schemas.workers import TokenSample, TtftSample

pytestmark = pytest.mark.anyio
MODEL = "fake-model"


async def test_finished_jobs_ttfts_and_token_counts_reach_redis(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    worker = running_worker(redis_url, FakeEngine(), model=MODEL, name="stats-w")
    async with AsyncRedisClient(redis_url) as client, worker:
        jobs = [
            await client.enqueue(model=MODEL, prompt=f"p{i}", sampling={"max_tokens": 7})
            for i in range(3)
        ]
        done = [await client.wait(job.id, timeout=30) for job in jobs]

        async def all_recorded() -> bool:
            return await redis.zcard(KEYS.ttft_samples(MODEL)) == 3

        await wait_for(all_recorded, 10)
        await wait_for(lambda: _generated(redis), 10)
    assert all(job.status is JobStatus.SUCCEEDED for job in done)
    raw = await redis.zrange(KEYS.ttft_samples(MODEL), 0, -1, withscores=True)
    recorded = {s.job_id: s.ttft_s for s in (TtftSample.parse(m, score) for m, score in raw)}
    assert recorded == {job.id: pytest.approx(job.result.timings.ttft_s, abs=1e-6) for job in done}
    raw = await redis.zrange(KEYS.token_samples(MODEL), 0, -1, withscores=True)
    samples = [TokenSample.parse(m, score) for m, score in raw]
    assert {s.worker for s in samples} == {"stats-w"}
    assert max(s.generated_tokens for s in samples) == 21  # 3 jobs x 7 tokens
    assert 0 < await redis.ttl(KEYS.token_samples(MODEL)) <= 15 * 60
    await redis.aclose()


async def _generated(redis: Redis) -> bool:
    return await redis.hget(KEYS.worker("stats-w"), "generated_tokens") == "21"
