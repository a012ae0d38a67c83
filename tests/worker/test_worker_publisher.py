"""The outbox against a real Redis: a re-sent chunk is refused by its replay id, never doubled."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from worker_harness import KEYS, replay_chunks

from schemas import JobStatus, TokenChunk
from worker.publisher import Outbox

pytestmark = pytest.mark.anyio


async def test_resent_chunks_land_once_and_keep_their_order(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    outbox = Outbox(KEYS, KEYS.jobs_stream("m"), "w")
    chunks = [TokenChunk(job_id="job_x", index=i, text=f"t{i}", token_ids=[i]) for i in range(3)]
    pubsub = redis.pubsub()
    await pubsub.subscribe(KEYS.channel("job_x"))
    await pubsub.get_message(timeout=1)
    for chunk in chunks[:2]:
        outbox.chunk(chunk)
    await outbox.flush(redis)
    for chunk in chunks:  # a re-sent pipeline (e.g. after a lost reply) repeats 0 and 1
        outbox.chunk(chunk, set_ttl=False)
    outbox.transition("job_x", JobStatus.RUNNING, {})  # a non-chunk op splits the run
    outbox.chunk(chunks[2])
    assert await outbox.flush(redis) == 5
    assert [c for _, c in await replay_chunks(redis, "job_x")] == chunks
    assert await redis.ttl(KEYS.out_stream("job_x")) > 0
    live = []
    while (
        message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
    ) is not None:
        live.append(TokenChunk.from_json(message["data"]).index)
    assert live == [0, 1, 0, 1, 2, 2]  # readers skip repeats by index
    await pubsub.aclose()


async def test_chunk_text_arrives_byte_for_byte_and_only_asked_ttls_are_set(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    outbox = Outbox(KEYS, KEYS.jobs_stream("m"), "w")
    texts = [
        '"quoted" \\ back',
        "naïve — 日本語 🙂",
        "tab\tnew\nline \x01",
        "\\u00e9 not an escape",
    ]
    chunks = [
        TokenChunk(job_id=f"job_{i}", index=0, text=text, token_ids=[i])
        for i, text in enumerate(texts)
    ]
    pubsub = redis.pubsub()
    await pubsub.psubscribe(KEYS.channel("") + "*")
    await pubsub.get_message(timeout=1)
    for i, chunk in enumerate(chunks):
        outbox.chunk(chunk, set_ttl=i % 2 == 0)
    await outbox.flush(redis)
    for i, chunk in enumerate(chunks):
        assert [c for _, c in await replay_chunks(redis, chunk.job_id)] == [chunk]
        stored = await redis.xrange(KEYS.out_stream(chunk.job_id))
        assert list(stored[0][1].values()) == [chunk.to_json()]
        assert (await redis.ttl(KEYS.out_stream(chunk.job_id)) > 0) == (i % 2 == 0)
    live = []
    while (
        message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
    ) is not None:
        live.append(message["data"])
    assert live == [chunk.to_json() for chunk in chunks]
    await pubsub.aclose()


async def test_what_the_next_step_needs_goes_out_alone_and_the_rest_follows_in_order(redis_url):
    """The first-step marker and the newcomers' starts are stored before the step without
    waiting for the last step's results, which the next flush still writes."""
    redis = Redis.from_url(redis_url, decode_responses=True)
    outbox = Outbox(KEYS, KEYS.jobs_stream("m"), "w")
    marker = KEYS.first_step("w")
    await redis.sadd(marker, "job_old")
    outbox.chunk(TokenChunk(job_id="job_old", index=0, text="done", token_ids=[1]))
    with outbox.ahead():
        outbox.clear_first_step()
    outbox.chunk(TokenChunk(job_id="job_old", index=1, text="!", token_ids=[2]))
    with outbox.ahead():
        outbox.mark_first_step(["job_new"])
    assert await outbox.flush(redis, ahead_only=True) == 2
    assert await redis.smembers(marker) == {"job_new"}  # cleared, then marked: not deleted
    assert await replay_chunks(redis, "job_old") == []
    assert await outbox.flush(redis, ahead_only=True) == 0
    assert await outbox.flush(redis) == 2
    assert [c.index for _, c in await replay_chunks(redis, "job_old")] == [0, 1]
    assert await redis.smembers(marker) == {"job_new"}
    await redis.aclose()
