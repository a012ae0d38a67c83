"""Entries a worker cannot read or parse (bytes that are not UTF-8, a job key that is no hash,
a status that is no status) are dead-lettered within one lease, and the good job read with them
finishes (fake engine, real Redis)."""

from __future__ import annotations

import json
import time

import pytest
from redis.asyncio import Redis
from worker_fakes import FakeEngine
from worker_harness import FAST, KEYS, running_worker, wait_for

from producer_api.client.redis_client import AsyncRedisClient
from schemas import ErrorCode, Job, JobRequest, JobStatus, new_job_id

pytestmark = pytest.mark.anyio
MODEL = "fake-model"
NOT_UTF8 = b"\xff\xfe\x80 not text"
LEASE_S = FAST["claim_min_idle_ms"] / 1000


async def _store_raw_job(redis: Redis, job: Job, **overrides: str | bytes) -> None:
    """Queue a job the way enqueue does, with some hash fields replaced (a corrupt writer)."""
    entry_id = await redis.xadd(KEYS.jobs_stream(MODEL), {"job": job.id})
    fields = {**job.to_redis_hash(), "entry_id": entry_id, **overrides}
    await redis.hset(KEYS.job(job.id), mapping=fields)


async def _queue_not_utf8_entry(redis: Redis) -> str:
    """A stored job whose stream entry carries a field that is not UTF-8."""
    job = Job.new(JobRequest(model=MODEL, prompt="entry"))
    entry_id = await redis.xadd(KEYS.jobs_stream(MODEL), {"job": job.id, "note": NOT_UTF8})
    await redis.hset(KEYS.job(job.id), mapping={**job.to_redis_hash(), "entry_id": entry_id})
    return job.id


async def _queue_not_utf8_request(redis: Redis) -> str:
    job = Job.new(JobRequest(model=MODEL, prompt="request"))
    await _store_raw_job(redis, job, request=b'{"prompt": "' + NOT_UTF8 + b'"}')
    return job.id


async def _queue_wrong_type(redis: Redis) -> str:
    job_id = new_job_id()
    await redis.xadd(KEYS.jobs_stream(MODEL), {"job": job_id})
    await redis.set(KEYS.job(job_id), "not a hash")
    return job_id


async def _queue_banana(redis: Redis) -> str:
    job = Job.new(JobRequest(model=MODEL, prompt="banana"))
    await _store_raw_job(redis, job, status="banana")
    return job.id


async def _queue_bad_params(redis: Redis) -> str:
    job = Job.new(JobRequest(model=MODEL, prompt="hi"))
    request = json.loads(job.request.to_json())
    request["sampling"]["temperature"] = 7.5
    await _store_raw_job(redis, job, request=json.dumps(request))
    return job.id


async def _queue_garbage(redis: Redis) -> None:
    await redis.xadd(KEYS.jobs_stream(MODEL), {"garbage": "yes"})


async def _queue_not_utf8_job_field(redis: Redis) -> None:
    await redis.xadd(KEYS.jobs_stream(MODEL), {"job": NOT_UTF8})


# poison kind -> (how to queue it, the job it fails (None: no readable job), whether that job's
# hash can hold the failed status, the dead letter's reason)
POISON = {
    "not_utf8_entry": (_queue_not_utf8_entry, True, ErrorCode.UNPARSEABLE_JOB),
    "not_utf8_request": (_queue_not_utf8_request, True, ErrorCode.UNPARSEABLE_JOB),
    "wrong_type": (_queue_wrong_type, False, ErrorCode.UNPARSEABLE_JOB),
    "status_banana": (_queue_banana, True, ErrorCode.UNPARSEABLE_JOB),
    "bad_params": (_queue_bad_params, True, ErrorCode.INVALID_REQUEST),
    "garbage": (_queue_garbage, False, ErrorCode.UNPARSEABLE_JOB),
    "not_utf8_job_field": (_queue_not_utf8_job_field, False, ErrorCode.UNPARSEABLE_JOB),
}


@pytest.mark.parametrize("kind", list(POISON))
async def test_poison_is_dead_lettered_within_a_lease_and_its_read_goes_on(redis_url, kind):
    queue, marks_failed, reason = POISON[kind]
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client:
        poison_job = await queue(redis)
        good = await client.enqueue(model=MODEL, prompt_token_ids=[21] * 5)
        started = time.monotonic()
        async with running_worker(redis_url, FakeEngine(), model=MODEL) as worker:
            letters = KEYS.dead_letters(MODEL)
            await wait_for(lambda: redis.xlen(letters), LEASE_S)
            assert time.monotonic() - started < LEASE_S
            [(_, letter)] = await redis.xrange(letters, "-", "+")
            assert letter["reason"] == reason.value
            assert letter["message"]
            assert letter["job"] == (poison_job or "")
            finished = await client.wait(good.id, timeout=10)
            assert finished.status is JobStatus.SUCCEEDED
            if marks_failed:
                stored = await redis.hget(KEYS.job(poison_job), "status")
                assert stored == JobStatus.FAILED.value
                error = json.loads(await redis.hget(KEYS.job(poison_job), "error"))
                assert error["code"] == reason.value
            await wait_for(lambda: _backlog_is(redis, 0), 5)
            assert worker.outcomes["dead_lettered"] == 1
            assert worker.outcomes["succeeded"] == 1
    await redis.aclose()


async def _backlog_is(redis: Redis, length: int) -> bool:
    return await redis.xlen(KEYS.jobs_stream(MODEL)) == length
