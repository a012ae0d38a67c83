"""Interactive before bulk: bulk jobs (priority >= PRIORITY_BULK) wait on the model's bulk
stream, which workers read only with the room the interactive stream leaves; reclaim, dead
letters, cancel, queue limits and hand-back cover the bulk stream too (fake engine)."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from worker_fakes import FakeEngine
from worker_harness import KEYS, running_worker, wait_for

from producer_api import queue
from schemas import PRIORITY_BULK, JobRequest, JobStatus
from worker.priority import PriorityReader, ReadPacing

pytestmark = pytest.mark.anyio
MODEL = "fake-model"


def request(i: int, *, bulk: bool, max_tokens: int = 6) -> JobRequest:
    return JobRequest(
        model=MODEL,
        stream=True,
        prompt_token_ids=[100 + i, 11, 12],
        sampling={"max_tokens": max_tokens},
        priority=PRIORITY_BULK if bulk else 0,
    )


async def statuses(redis: Redis, job_ids: list[str]) -> list[str | None]:
    return [await redis.hget(KEYS.job(j), "status") for j in job_ids]


async def test_interactive_jobs_overtake_a_bulk_backlog_and_bulk_still_finishes(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    bulk = [await queue.enqueue(redis, KEYS, request(i, bulk=True)) for i in range(40)]
    interactive = [await queue.enqueue(redis, KEYS, request(i, bulk=False)) for i in range(3)]
    assert await redis.xlen(KEYS.bulk_stream(MODEL)) == 40
    assert await redis.xlen(KEYS.jobs_stream(MODEL)) == 3
    engine = FakeEngine(step_seconds=0.01)
    async with running_worker(redis_url, engine, served_model_name=MODEL, bulk_max_held=2):
        await wait_for(lambda: _all_done(redis, [j.id for j in interactive]), timeout=30)
        bulk_done = sum(s == "succeeded" for s in await statuses(redis, [j.id for j in bulk]))
        assert bulk_done <= 4  # at most the two held when the worker started, and their successors
        await wait_for(lambda: _all_done(redis, [j.id for j in bulk]), timeout=60)
    assert await redis.xlen(KEYS.bulk_stream(MODEL)) == 0
    await redis.aclose()


async def test_one_read_takes_interactive_entries_first_and_bulk_ones_with_the_room_left(
    redis_url,
):
    redis = Redis.from_url(redis_url)
    reader = PriorityReader(redis, KEYS, MODEL, "reader")
    await reader.ensure_group()
    bulk = [await redis.xadd(reader.bulk_stream, {"job": f"b{i}"}) for i in range(4)]
    interactive = [await redis.xadd(reader.stream, {"job": f"i{i}"}) for i in range(2)]
    await redis.xadd(reader.stream, {"job": b"\xff not text"})

    first = await reader.read_new(4, None, bulk_room=1)
    assert [(e.stream, e.fields) for e in first[:2]] == [
        (reader.stream, {"job": "i0"}),
        (reader.stream, {"job": "i1"}),
    ]
    assert first[2].stream == reader.stream and first[2].unreadable is not None
    assert [(e.entry_id, e.stream) for e in first[3:]] == [(bulk[0].decode(), reader.bulk_stream)]
    assert [e.entry_id for e in first[:2]] == [i.decode() for i in interactive]

    rest = await reader.read_new(10, None)  # no cap: every bulk entry left
    assert [e.fields for e in rest] == [{"job": f"b{i}"} for i in (1, 2, 3)]
    assert await reader.read_new(10, None) == []
    await redis.aclose()


async def _all_done(redis: Redis, job_ids: list[str]) -> bool:
    return all(s == "succeeded" for s in await statuses(redis, job_ids))


async def test_bulk_jobs_of_a_dead_worker_are_reclaimed(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    job = await queue.enqueue(redis, KEYS, request(1, bulk=True))
    stream = KEYS.bulk_stream(MODEL)
    await redis.xgroup_create(stream, KEYS.group, id="0", mkstream=True)
    await redis.xreadgroup(KEYS.group, "dead-worker", {stream: ">"}, count=10)  # never acked
    async with running_worker(
        redis_url, FakeEngine(), served_model_name=MODEL, claim_min_idle_ms=300
    ):
        await wait_for(lambda: _all_done(redis, [job.id]), timeout=30)
    assert await redis.xlen(stream) == 0
    assert (await redis.xpending(stream, KEYS.group))["pending"] == 0
    await redis.aclose()


async def test_a_poison_bulk_entry_is_dead_lettered_and_acked(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    stream = KEYS.bulk_stream(MODEL)
    await redis.xadd(stream, {"garbage": "1"})
    good = await queue.enqueue(redis, KEYS, request(2, bulk=True))
    async with running_worker(redis_url, FakeEngine(), served_model_name=MODEL):
        await wait_for(lambda: _all_done(redis, [good.id]), timeout=30)
        await wait_for(lambda: redis.xlen(KEYS.dead_letters(MODEL)), timeout=10)
    ((_, letter),) = await redis.xrange(KEYS.dead_letters(MODEL))
    assert letter["reason"] == "unparseable_job"
    assert await redis.xlen(stream) == 0
    await redis.aclose()


async def test_cancel_and_queue_limit_treat_the_streams_apart(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    queued = [await queue.enqueue(redis, KEYS, request(i, bulk=True)) for i in range(3)]
    cancelled = await queue.cancel_job(redis, KEYS, queued[0].id)
    assert cancelled.status is JobStatus.CANCELLED
    assert await queue.queue_length(redis, KEYS, MODEL, bulk=True) == 2
    # a bulk backlog does not count against the interactive queue limit
    await queue.enqueue(redis, KEYS, request(9, bulk=False), max_queue_len=1)
    with pytest.raises(queue.QueueFullError):
        await queue.enqueue(redis, KEYS, request(10, bulk=False), max_queue_len=1)
    await redis.aclose()


async def test_a_stopping_worker_hands_bulk_jobs_back_to_the_bulk_stream(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    job = await queue.enqueue(redis, KEYS, request(3, bulk=True, max_tokens=200))
    async with running_worker(redis_url, FakeEngine(step_seconds=0.01), served_model_name=MODEL):
        await wait_for(lambda: redis.xlen(KEYS.out_stream(job.id)), timeout=30)
    stored = await queue.get_job(redis, KEYS, job.id)
    assert stored.status in (JobStatus.QUEUED, JobStatus.RUNNING)
    entries = await redis.xrange(KEYS.bulk_stream(MODEL))
    assert [fields["job"] for _, fields in entries] == [job.id]
    assert await redis.xlen(KEYS.jobs_stream(MODEL)) == 0
    await asyncio.sleep(0)
    await redis.aclose()


def test_only_long_steps_get_a_second_read_and_none_waits():
    """A job arriving mid-step is read right after a long step (so it joins the next one);
    nothing ever blocks on Redis while the engine could run: a timed-out blocked read comes
    back only at Redis' next tick, up to 100 ms late."""
    assert not ReadPacing.read_between_steps(0.005)
    assert ReadPacing.read_between_steps(0.250)
