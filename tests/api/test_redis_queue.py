"""producer_api.queue and the Redis clients against a real Redis and a contract-following fake
worker: enqueue -> chunks -> result, replay for late subscribers, idempotency, cancel, backlog."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
import redis as sync_redis
from redis.asyncio import Redis

from producer_api import queue
from producer_api.client import AsyncRedisClient, RedisClient
from schemas import (
    ControlMessage,
    ErrorCode,
    JobRequest,
    JobStatus,
    RedisKeys,
    TokenChunk,
    new_job_id,
    utc_now,
)
from tests.api.fake_worker import FakeWorker, echo_pieces

pytestmark = pytest.mark.anyio

MODEL = "org/echo-model:v1"  # "/" and ":" must survive the key encoding
KEYS = RedisKeys()
POLL = 0.2


def request(prompt: str = "the quick brown fox jumps", **fields) -> JobRequest:
    return JobRequest(model=MODEL, prompt=prompt, stream=True, **fields)


@pytest.fixture
async def aredis(redis_url):
    client = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def worker(aredis):
    fake = FakeWorker(aredis, KEYS, MODEL)
    await fake.create_group()
    return fake


async def collect(redis: Redis, job_id: str, last_index: int = -1) -> list[TokenChunk]:
    chunks = queue.stream_chunks(redis, KEYS, job_id, last_index=last_index, poll_interval=POLL)
    return [chunk async for chunk in chunks]


async def test_enqueue_stores_a_queued_job_and_one_stream_entry(aredis):
    job = await queue.enqueue(aredis, KEYS, request(priority=3))
    assert job.status is JobStatus.QUEUED and job.entry_id
    assert await queue.get_job(aredis, KEYS, job.id) == job
    entries = await aredis.xrange(KEYS.jobs_stream(MODEL))
    assert entries == [(job.entry_id, {"job": job.id})]
    assert await queue.queue_length(aredis, KEYS, MODEL) == 1


@pytest.mark.parametrize("decode", [True, False])
async def test_enqueue_then_chunks_then_result(redis_url, worker, decode):
    client = Redis.from_url(redis_url, decode_responses=decode)
    try:
        job = await queue.enqueue(client, KEYS, request())
        streamed = asyncio.create_task(collect(client, job.id))
        waited = asyncio.create_task(queue.wait_job(client, KEYS, job.id, poll_interval=POLL))
        await asyncio.sleep(0.1)  # let both listeners subscribe before the worker starts
        claimed = await worker.serve_one()
        chunks = await asyncio.wait_for(streamed, 10)
        done = await asyncio.wait_for(waited, 10)
    finally:
        await client.aclose()
    assert claimed.job.id == job.id
    assert [c.index for c in chunks] == list(range(len(echo_pieces(job))))
    assert "".join(c.text for c in chunks) == job.request.prompt
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert done.status is JobStatus.SUCCEEDED
    assert done.result.choices[0].text == job.request.prompt
    assert done.attempts == 1 and done.worker == worker.name
    assert done.result.timings.queue_wait_s >= 0
    assert await queue.queue_length(worker.redis, KEYS, MODEL) == 0
    assert await worker.redis.ttl(KEYS.job(job.id)) > 0


async def test_late_subscriber_replays_every_chunk_exactly_once(aredis, worker):
    job = await queue.enqueue(aredis, KEYS, request("a b c d e f g h"))
    claimed = await worker.claim()
    chunks = worker.chunks_of(claimed.job)
    await worker.publish(chunks[:3])  # published before anyone listens

    streamed = asyncio.create_task(collect(aredis, job.id))
    await asyncio.sleep(0.2)
    await worker.publish(chunks[2:5])  # chunk 2 again: a re-run repeating itself
    await worker.publish(chunks[5:])
    await worker.finish(claimed, chunks)
    got = await asyncio.wait_for(streamed, 10)
    assert got == chunks

    # after the end: a new listener gets everything, a reconnecting one only what it missed
    assert await collect(aredis, job.id) == chunks
    assert await collect(aredis, job.id, last_index=4) == chunks[5:]
    assert await collect(aredis, job.id, last_index=len(chunks) - 1) == []


async def test_lost_live_messages_are_filled_from_the_replay_stream(aredis, worker):
    job = await queue.enqueue(aredis, KEYS, request("one two three four five"))
    claimed = await worker.claim()
    chunks = worker.chunks_of(claimed.job)
    streamed = asyncio.create_task(collect(aredis, job.id))
    await asyncio.sleep(0.2)
    await worker.publish(chunks[:1])
    await worker.publish(chunks[1:3], live=False)  # pub/sub dropped these two
    await worker.publish(chunks[3:4])
    await worker.publish(chunks[3:4], replay=False)  # and delivered this one twice
    await worker.publish(chunks[4:])
    got = await asyncio.wait_for(streamed, 10)
    assert got == chunks


async def test_stream_ends_when_the_job_ends_without_a_final_chunk(aredis, worker):
    job = await queue.enqueue(aredis, KEYS, request("x y z"))
    claimed = await worker.claim()
    chunks = worker.chunks_of(claimed.job)
    streamed = asyncio.create_task(collect(aredis, job.id))
    await asyncio.sleep(0.2)
    await worker.publish(chunks[:2])
    cancelled = await queue.cancel_job(aredis, KEYS, job.id)
    got = await asyncio.wait_for(streamed, 10)
    assert cancelled.status is JobStatus.CANCELLED
    assert got == chunks[:2]
    # the worker finishing afterwards cannot overwrite the cancel
    assert not await worker.finish(claimed, chunks)
    assert (await queue.get_job(aredis, KEYS, job.id)).status is JobStatus.CANCELLED


async def test_idempotency_key_returns_the_same_job(aredis):
    first = await queue.enqueue(aredis, KEYS, request(idempotency_key="order-42"), owner="alice")
    again = await queue.enqueue(aredis, KEYS, request(idempotency_key="order-42"), owner="alice")
    assert again == first
    assert await queue.queue_length(aredis, KEYS, MODEL) == 1

    other_owner = await queue.enqueue(
        aredis, KEYS, request(idempotency_key="order-42"), owner="bob"
    )
    assert other_owner.id != first.id

    await aredis.delete(KEYS.job(first.id))  # the first job's record expired
    fresh = await queue.enqueue(aredis, KEYS, request(idempotency_key="order-42"), owner="alice")
    assert fresh.id != first.id
    assert (
        await queue.enqueue(aredis, KEYS, request(idempotency_key="order-42"), owner="alice")
        == fresh
    )


async def test_concurrent_enqueues_with_one_idempotency_key_make_one_job(aredis):
    jobs = await asyncio.gather(
        *(queue.enqueue(aredis, KEYS, request(idempotency_key="same")) for _ in range(20))
    )
    assert len({job.id for job in jobs}) == 1
    assert await queue.queue_length(aredis, KEYS, MODEL) == 1


async def test_cancel_a_queued_job(aredis, worker):
    job = await queue.enqueue(aredis, KEYS, request())
    control = aredis.pubsub()
    await control.subscribe(KEYS.control_channel())
    await control.get_message(timeout=2)  # subscribe confirmation

    cancelled = await queue.cancel_job(aredis, KEYS, job.id)
    assert cancelled.status is JobStatus.CANCELLED
    assert cancelled.error.code is ErrorCode.CANCELLED and cancelled.finished_at is not None
    message = await control.get_message(ignore_subscribe_messages=True, timeout=2)
    assert ControlMessage.from_json(message["data"]) == ControlMessage(op="cancel", job_id=job.id)
    await control.aclose()

    assert await queue.queue_length(aredis, KEYS, MODEL) == 0  # the entry left the stream
    assert await worker.claim(block_ms=100) is None
    assert (await queue.wait_job(aredis, KEYS, job.id, timeout=5)).status is JobStatus.CANCELLED
    assert await collect(aredis, job.id) == []
    # cancelling again, or a finished job, changes nothing
    assert await queue.cancel_job(aredis, KEYS, job.id) == cancelled


async def test_cancel_wakes_a_waiter(aredis, worker):
    job = await queue.enqueue(aredis, KEYS, request())
    await worker.claim()
    waiter = asyncio.create_task(queue.wait_job(aredis, KEYS, job.id, poll_interval=30))
    await asyncio.sleep(0.2)
    await queue.cancel_job(aredis, KEYS, job.id)
    done = await asyncio.wait_for(waiter, 5)  # woken by the status event, not the 30 s poll
    assert done.status is JobStatus.CANCELLED


async def test_a_full_queue_refuses_new_jobs(aredis, worker):
    for _ in range(2):
        await queue.enqueue(aredis, KEYS, request(), max_queue_len=2)
    with pytest.raises(queue.QueueFullError) as info:
        await queue.enqueue(aredis, KEYS, request(), max_queue_len=2)
    assert info.value.code is ErrorCode.QUEUE_FULL
    assert (info.value.backlog, info.value.limit) == (2, 2)
    assert await queue.queue_length(aredis, KEYS, MODEL) == 2

    await worker.serve_one()  # a finished job leaves the backlog
    await queue.enqueue(aredis, KEYS, request(), max_queue_len=2)
    # other models have their own queue
    await queue.enqueue(aredis, KEYS, JobRequest(model="other", prompt="hi"), max_queue_len=2)


async def test_wait_times_out_with_the_job_as_it_is(aredis):
    job = await queue.enqueue(aredis, KEYS, request())
    waited = await queue.wait_job(aredis, KEYS, job.id, timeout=0.3, poll_interval=POLL)
    assert waited.status is JobStatus.QUEUED


@pytest.mark.parametrize("job_id", [new_job_id(), "not-a-job-id", "job_" + "x" * 100])
async def test_unknown_jobs_are_not_found(aredis, job_id):
    for call in (
        queue.get_job(aredis, KEYS, job_id),
        queue.wait_job(aredis, KEYS, job_id, timeout=1),
        queue.cancel_job(aredis, KEYS, job_id),
        collect(aredis, job_id),
    ):
        with pytest.raises(queue.JobNotFoundError) as info:
            await call
        assert info.value.code is ErrorCode.NOT_FOUND


async def test_a_deadline_in_the_past_is_refused(aredis):
    with pytest.raises(queue.QueueError) as info:
        await queue.enqueue(aredis, KEYS, request(deadline=utc_now() - timedelta(seconds=1)))
    assert info.value.error.param == "deadline"
    assert await queue.queue_length(aredis, KEYS, MODEL) == 0


async def test_async_client_end_to_end(redis_url, worker):
    async with AsyncRedisClient(redis_url, owner="svc", poll_interval=POLL) as client:
        job = await client.enqueue(model=MODEL, prompt="hello there world", stream=True)
        assert job.owner == "svc"
        served = asyncio.create_task(worker.serve_one())
        chunks = [chunk async for chunk in client.stream(job.id)]
        await served
        assert "".join(c.text for c in chunks) == "hello there world"
        assert (await client.get(job.id)).status is JobStatus.SUCCEEDED
        ran = asyncio.create_task(client.run({"model": MODEL, "prompt": "a b"}, timeout=10))
        await worker.serve_one()
        assert (await ran).result.choices[0].text == "a b"


def _serve_in_thread(url: str, count: int) -> threading.Thread:
    async def serve() -> None:
        redis = Redis.from_url(url, decode_responses=True)
        fake = FakeWorker(redis, KEYS, MODEL)
        await fake.create_group()
        for _ in range(count):
            while await fake.serve_one() is None:
                pass
        await redis.aclose()

    thread = threading.Thread(target=asyncio.run, args=(serve(),))
    thread.start()
    return thread


def test_sync_client_end_to_end(redis_url):
    with RedisClient(redis_url, poll_interval=POLL) as client:
        job = client.enqueue(request("sync clients stream too"))
        thread = _serve_in_thread(redis_url, 2)
        text = "".join(chunk.text for chunk in client.stream(job.id))
        assert text == job.request.prompt
        assert client.wait(job.id, timeout=10).status is JobStatus.SUCCEEDED
        done = client.run(model=MODEL, prompt="then run", timeout=10)
        assert done.result.choices[0].text == "then run"
        thread.join(10)
        queued = client.enqueue(request())
        assert client.cancel(queued.id).status is JobStatus.CANCELLED


def test_queued_jobs_survive_a_redis_crash(redis_server):
    async def enqueue() -> str:
        redis = Redis.from_url(redis_server.url, decode_responses=True)
        job = await queue.enqueue(redis, KEYS, request())
        await redis.aclose()
        return job.id

    job_id = asyncio.run(enqueue())
    redis_server.kill()
    redis_server.start()
    client = sync_redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert client.hget(KEYS.job(job_id), "status") == "queued"
    assert client.xlen(KEYS.jobs_stream(MODEL)) == 1
    client.close()
