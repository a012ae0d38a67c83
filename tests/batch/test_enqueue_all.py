"""A fan-out round's jobs enqueued in one pipelined round trip: each line gets one job on the
model's bulk stream, a line enqueued again gets its first job back (a controller resumed after a
kill makes no duplicates), and a line past its deadline is refused alone."""

from __future__ import annotations

from datetime import timedelta

import pytest
from redis.asyncio import Redis

from producer_api import queue
from producer_api.batches.enqueue_all import enqueue_all
from schemas import PRIORITY_BULK, Job, JobRequest, JobStatus, RedisKeys, utc_now

pytestmark = pytest.mark.anyio

MODEL = "embed-model"
KEYS = RedisKeys()


@pytest.fixture
async def aredis(redis_url):
    client = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


def line_request(number: int, **fields) -> JobRequest:
    return JobRequest(
        model=MODEL,
        prompt=f"line {number}",
        priority=PRIORITY_BULK,
        idempotency_key=f"batch_x:{number}",
        **fields,
    )


async def test_each_line_gets_one_job_and_enqueueing_again_returns_it(aredis):
    requests = [line_request(n) for n in range(1, 51)]
    first = await enqueue_all(aredis, KEYS, requests, owner="alice", replicas=None)
    assert all(isinstance(job, Job) for job in first)
    assert len({job.id for job in first}) == 50  # type: ignore[union-attr]
    assert await queue.queue_length(aredis, KEYS, MODEL, bulk=True) == 50
    stored = await queue.get_job(aredis, KEYS, first[7].id)  # type: ignore[union-attr]
    assert stored.status is JobStatus.QUEUED and stored.request.prompt == "line 8"
    again = await enqueue_all(aredis, KEYS, requests, owner="alice", replicas=None)
    assert [job.id for job in again] == [job.id for job in first]  # type: ignore[union-attr]
    assert await queue.queue_length(aredis, KEYS, MODEL, bulk=True) == 50


async def test_a_line_past_its_deadline_is_refused_alone(aredis):
    past = utc_now() - timedelta(seconds=5)
    requests = [line_request(1), line_request(2, deadline=past), line_request(3)]
    results = await enqueue_all(aredis, KEYS, requests, owner=None, replicas=None)
    assert isinstance(results[0], Job) and isinstance(results[2], Job)
    assert isinstance(results[1], queue.QueueError)
    assert results[1].error.param == "deadline"
    assert await queue.queue_length(aredis, KEYS, MODEL, bulk=True) == 2
