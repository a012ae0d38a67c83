"""A model's queue split into partition streams on a single Redis: enqueue spreads jobs over
them, one worker reads them all, and the backlog counts every partition."""

from __future__ import annotations

import pytest
from worker_fakes import FakeEngine, expected_output
from worker_harness import running_worker

from producer_api.client.redis_client import AsyncRedisClient
from producer_api.queue import queue_length
from schemas import JobStatus
from schemas.redis_connection import RedisConnectionSettings

pytestmark = pytest.mark.anyio
MODEL = "fake-model"


async def test_one_worker_serves_every_partition(redis_url):
    settings = RedisConnectionSettings(redis_url=redis_url, redis_queue_partitions=3)
    async with AsyncRedisClient(settings) as client:
        jobs = [
            await client.enqueue(
                model=MODEL, prompt_token_ids=[30 + i, 4], sampling={"max_tokens": 3}
            )
            for i in range(12)
        ]
        used = {client.keys.queue_stream(MODEL, 0, job.id) for job in jobs}
        assert len(used) == 3  # the jobs spread over all three streams
        assert await queue_length(client.redis, client.keys, MODEL) == 12
        async with running_worker(redis_url, FakeEngine(), model=MODEL, redis_queue_partitions=3):
            done = [await client.wait(job.id, timeout=20) for job in jobs]
        for job in done:
            assert job.status is JobStatus.SUCCEEDED
            ids, _ = expected_output(job.request.prompt_token_ids, 3)
            assert job.result.choices[0].token_ids == ids
        assert await queue_length(client.redis, client.keys, MODEL) == 0
