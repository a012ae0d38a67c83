"""The relay's savings against a real Redis: no PUBLISH for a job nobody subscribes to, yet a
subscriber that joins mid-job (subscribe, then replay) gets every chunk exactly once; scripts go
by EVALSHA and survive Redis forgetting them."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from worker_fakes import FakeEngine, expected_output
from worker_harness import (
    KEYS,
    check_delivery,
    replay_chunks,
    running_worker,
    stream_all,
    wait_for,
)

from producer_api.client.redis_client import AsyncRedisClient
from producer_api.queue import stream_chunks
from schemas import JobStatus, TokenChunk
from schemas.jobs import new_job_id
from worker.chunk_relay import Listeners
from worker.publisher import Outbox
from worker.settings import WorkerSettings

pytestmark = pytest.mark.anyio
JOB = new_job_id()


def _chunk(index: int, final: bool = False) -> TokenChunk:
    return TokenChunk(
        job_id=JOB,
        index=index,
        text=f" t{index}",
        token_ids=[index],
        finish_reason="length" if final else None,
        final=final,
    )


async def _drain(pubsub) -> list[int]:
    heard = []
    while (
        message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.3)
    ) is not None:
        heard.append(TokenChunk.from_json(message["data"]).index)
    return heard


async def test_unheard_jobs_are_not_published_and_a_late_subscriber_misses_nothing(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    outbox = Outbox(KEYS, KEYS.jobs_stream("m"), "w")
    await redis.hset(KEYS.job(JOB), "status", JobStatus.RUNNING.value)
    published_before = (await redis.info("commandstats")).get("cmdstat_publish", {}).get("calls", 0)
    for index in range(3):  # nobody listens: only the first chunk (before any look) goes live
        outbox.chunk(_chunk(index))
        await outbox.flush(redis)
    published = (await redis.info("commandstats"))["cmdstat_publish"]["calls"] - published_before
    assert published == 1
    assert not outbox.listeners.publishes(JOB)

    pubsub = redis.pubsub()
    await pubsub.subscribe(KEYS.channel(JOB))
    await pubsub.get_message(timeout=1)
    outbox.chunk(_chunk(3))  # written unpublished: the look after it finds the subscriber
    await outbox.flush(redis)
    assert outbox.listeners.publishes(JOB)
    outbox.chunk(_chunk(4, final=True))  # the catch-up of 3 goes first
    await outbox.flush(redis)
    assert await _drain(pubsub) == [3, 4]
    await pubsub.aclose()
    assert [c.index for _, c in await replay_chunks(redis, JOB)] == [0, 1, 2, 3, 4]
    await redis.aclose()


async def test_a_client_that_subscribes_between_writes_streams_every_chunk_once(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    outbox = Outbox(KEYS, KEYS.jobs_stream("m"), "w")
    await redis.hset(KEYS.job(JOB), "status", JobStatus.RUNNING.value)
    for index in range(2):
        outbox.chunk(_chunk(index))
        await outbox.flush(redis)
    stream = stream_chunks(redis, KEYS, JOB, poll_interval=30.0)
    seen = [await anext(stream), await anext(stream)]  # subscribed, then replayed 0 and 1
    for index in range(2, 6):  # the job goes on; the client follows live, never by polling
        outbox.chunk(_chunk(index, final=index == 5))
        await outbox.flush(redis)
    await outbox.flush(redis)  # catch-up
    seen += [chunk async for chunk in stream]
    assert [c.index for c in seen] == list(range(6))
    await redis.aclose()


async def test_transitions_go_by_evalsha_and_survive_a_script_flush(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    await redis.config_resetstat()  # the server is shared: count this test's commands alone
    outbox = Outbox(KEYS, KEYS.jobs_stream("m"), "w")
    await redis.hset(KEYS.job("job_s"), "status", JobStatus.QUEUED.value)
    done: list[tuple[bool, JobStatus | None]] = []
    outbox.transition("job_s", JobStatus.RUNNING, {}, lambda *reply: done.append(reply))
    await outbox.flush(redis)
    assert done == [(True, JobStatus.QUEUED)]
    await redis.script_flush()  # e.g. an operator, or a master that never saw the script
    outbox.transition("job_s", JobStatus.SUCCEEDED, {}, lambda *reply: done.append(reply))
    await outbox.flush(redis)  # NOSCRIPT: sent again at once, loaded first
    assert done[1:] == [(True, JobStatus.RUNNING)]
    assert await outbox.flush(redis) == 0  # nothing left over for the next flush
    assert await redis.hget(KEYS.job("job_s"), "status") == JobStatus.SUCCEEDED.value
    stats = await redis.info("commandstats")
    assert "cmdstat_eval" not in stats and stats["cmdstat_evalsha"]["calls"] >= 3
    await redis.aclose()


async def test_the_default_relay_coalesces_yet_every_client_gets_every_token_once(redis_url):
    # The worker's own defaults (the harness pins a chunk per step for the other tests).
    defaults = {
        name: WorkerSettings.model_fields[name].default
        for name in ("chunk_tokens", "chunk_interval_ms", "chunk_unwatched_ms")
    }
    engine = FakeEngine(step_seconds=0.002)
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, engine, model="relay-m", **defaults),
    ):
        requests = [([20 + i, 21, 22], 60) for i in range(6)]
        jobs = [
            await client.enqueue(
                model="relay-m", prompt_token_ids=prompt, stream=True, sampling={"max_tokens": n}
            )
            for prompt, n in requests
        ]
        followed = jobs[:3]  # a streaming client each; nobody listens to the others
        streamed = await asyncio.gather(*(stream_all(client, job.id) for job in followed))
        for job in jobs[3:]:
            await wait_for(lambda job=job: _finished(client, job.id))
        redis = Redis.from_url(redis_url, decode_responses=True)
        for job, (prompt, n) in zip(jobs, requests, strict=True):
            done = await client.get(job.id)
            replayed = [c for _, c in await replay_chunks(redis, job.id)]
            chunks = streamed[jobs.index(job)] if job in followed else replayed
            await check_delivery(redis, done, chunks, None, expected_output(prompt, n))
            if job not in followed:  # nobody waits for it: far fewer entries than tokens
                assert len(replayed) < n / 4
        await redis.aclose()


async def _finished(client: AsyncRedisClient, job_id: str) -> bool:
    return (await client.get(job_id)).status is JobStatus.SUCCEEDED


async def test_an_outbox_with_nothing_to_write_looks_for_subscribers_once_per_interval(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    outbox = Outbox(KEYS, KEYS.jobs_stream("m"), "w", listeners=Listeners(look_interval_s=0.3))
    await redis.hset(KEYS.job(JOB), "status", JobStatus.RUNNING.value)
    outbox.chunk(_chunk(0))
    await outbox.flush(redis)  # the chunk, then the look: nobody listens
    assert not outbox.listeners.publishes(JOB)
    assert not outbox.pending  # no round trip only to look again at once
    outbox.chunk(_chunk(1))
    assert outbox.pending  # a chunk goes out (and looks) whenever it is due
    await outbox.flush(redis)
    await asyncio.sleep(0.35)
    assert outbox.pending  # the interval passed: a look alone is due
    await redis.aclose()
