"""A busy worker reads its streams when its model's arrivals channel says something came, not
at every step: a job enqueued mid-batch still joins the next step, an idle Redis sees no reads
per step, and an entry added without a notice is still served (fake engine, real Redis)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from redis.asyncio import Redis
from worker_fakes import FakeEngine
from worker_harness import KEYS, running_worker, wait_for

import worker.pulling as pulling_module
from producer_api.client.redis_client import AsyncRedisClient
from schemas import Job, JobField, JobRequest, JobStatus
from schemas.keys import JOB_ENTRY_FIELD

pytestmark = pytest.mark.anyio
MODEL = "fake-model"


def _request(first_token: int, max_tokens: int) -> dict[str, object]:
    return dict(
        model=MODEL,
        prompt_token_ids=[first_token, 12, 13],
        stream=True,
        sampling={"max_tokens": max_tokens},
    )


async def _chunks(redis: Redis, job_id: str) -> int:
    return await redis.xlen(KEYS.out_stream(job_id))


@asynccontextmanager
async def _serving(
    redis_url: str, step_seconds: float
) -> AsyncIterator[tuple[AsyncRedisClient, FakeEngine]]:
    engine = FakeEngine(step_seconds=step_seconds)
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, engine, model=MODEL),
    ):
        yield client, engine


async def _running(client: AsyncRedisClient, first_token: int, max_tokens: int) -> Job:
    """A job enqueued and seen publishing its first chunk."""
    job = await client.enqueue(**_request(first_token, max_tokens))
    await wait_for(lambda: _chunks(client.redis, job.id), interval=0.005)
    return job


async def test_a_job_enqueued_mid_batch_joins_the_next_step(redis_url, monkeypatch):
    # Without the notice, this worker would not look for new entries for a minute.
    monkeypatch.setattr(pulling_module, "UNPROMPTED_READ_S", 60.0)
    async with _serving(redis_url, 0.05) as (client, engine):
        long = await _running(client, 11, 200)
        steps_before = engine.steps
        late = await client.enqueue(**_request(21, 4))
        await wait_for(lambda: _chunks(client.redis, late.id), interval=0.005)
        # the step running when it came, then the one it joined
        assert engine.steps - steps_before <= 2
        assert (await client.wait(late.id, timeout=20)).status is JobStatus.SUCCEEDED
        assert (await client.get(long.id)).status is JobStatus.RUNNING


async def test_a_busy_worker_with_nothing_new_does_not_read_at_every_step(redis_url):
    async with _serving(redis_url, 0.02) as (client, engine):
        job = await _running(client, 11, 60)
        await client.redis.config_resetstat()
        steps_before, started = engine.steps, time.monotonic()
        assert (await client.wait(job.id, timeout=20)).status is JobStatus.SUCCEEDED
        steps, seconds = engine.steps - steps_before, time.monotonic() - started
        reads = (await client.redis.info("commandstats")).get("cmdstat_xreadgroup", {})
    assert steps >= 40
    # a read (of both streams) every UNPROMPTED_READ_S, not one per step
    assert reads.get("calls", 0) <= 2 * (seconds / pulling_module.UNPROMPTED_READ_S + 2)


async def test_an_entry_added_without_a_notice_is_served_while_the_worker_is_busy(redis_url):
    async with _serving(redis_url, 0.05) as (client, _):
        long = await _running(client, 11, 200)
        # a producer of its own, which follows the stream contract but publishes nothing
        quiet = Job.new(JobRequest.model_validate(_request(21, 4)))
        redis = client.redis
        await redis.hset(KEYS.job(quiet.id), mapping=quiet.to_redis_hash())
        entry = await redis.xadd(KEYS.jobs_stream(MODEL), {JOB_ENTRY_FIELD: quiet.id})
        await redis.hset(KEYS.job(quiet.id), JobField.ENTRY_ID, entry)
        assert (await client.wait(quiet.id, timeout=20)).status is JobStatus.SUCCEEDED
        assert (await client.get(long.id)).status is JobStatus.RUNNING
