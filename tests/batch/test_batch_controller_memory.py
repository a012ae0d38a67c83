"""A batch controller's memory follows the lines in flight, not the batch: a five times longer
embedding batch runs through BatchRunner with about the same peak of Python memory and the same
most jobs held at once. Jobs end as soon as they are enqueued (a stand-in worker writes each
job's vector into its hash and announces its end, as a worker does), so no model is needed."""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from datetime import UTC, datetime

import pytest
from redis.asyncio import Redis

from producer_api import queue
from producer_api.batches import fan_out as fan_out_module
from producer_api.batches.files import BATCH_PURPOSE, FileStore
from producer_api.batches.runner import BatchRunner, Lease
from producer_api.batches.settings import BatchControllerSettings
from producer_api.batches.store import BatchStore
from redis_io.clients import redis_client
from schemas import Job, JobField, JobRequest, JobStatus, RedisKeys
from schemas.jobs import encode_hash_value
from schemas.results import ChoiceResult, JobResult, Timings, Usage

IN_FLIGHT = 100
DIMENSIONS = 384
T0 = datetime(2030, 1, 1, tzinfo=UTC)
_VECTOR = [i / DIMENSIONS for i in range(DIMENSIONS)]


def _result(request: JobRequest) -> str:
    """A worker's result for `request`: a vector per input (3 tokens each)."""
    inputs = request.input_count
    several = request.inputs is not None
    return encode_hash_value(
        JobResult(
            choices=[ChoiceResult(index=0, text="", token_ids=[], finish_reason="stop")],
            usage=Usage.of(3 * inputs, 0, 0),
            timings=Timings.from_times(T0, T0, None, T0),
            embedding=None if several else _VECTOR,
            embeddings=[_VECTOR] * inputs if several else None,
            input_tokens=[3] * inputs if several else None,
        )
    )


def _input(lines: int) -> str:
    rows = (
        {
            "custom_id": f"d-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "m", "input": f"Document {i}: notes on queues, for reader {i % 97}."},
        }
        for i in range(lines)
    )
    return "".join(json.dumps(row) + "\n" for row in rows)


def _ending_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job enqueued ends at once with a vector, announced to its batch."""
    enqueue_all = fan_out_module.enqueue_all

    async def enqueue_and_end(
        redis: Redis, keys: RedisKeys, requests: list[JobRequest], **kwargs: object
    ) -> list[Job | BaseException]:
        results = await enqueue_all(redis, keys, requests, **kwargs)  # type: ignore[arg-type]
        async with redis.pipeline(transaction=False) as pipe:
            for request, job in zip(requests, results, strict=True):
                assert isinstance(job, Job)
                result = _result(request)
                fields = {JobField.STATUS: JobStatus.SUCCEEDED.value, JobField.RESULT: result}
                pipe.hset(keys.job(job.id), mapping=fields)
                pipe.rpush(keys.batch_ended(request.metadata["batch_id"]), job.id)
            await pipe.execute()
        return results

    async def no_backlog(*args: object, **kwargs: object) -> int:
        return 0  # the stand-in worker takes each job off the stream at once

    monkeypatch.setattr(fan_out_module, "enqueue_all", enqueue_and_end)
    monkeypatch.setattr(queue, "queue_length", no_backlog)


async def _run_batch(redis_url: str, lines: int) -> tuple[int, int, dict[str, str]]:
    """(peak traced bytes, most jobs held at once, the batch's record) of one run over it."""
    settings = BatchControllerSettings(
        redis_url=redis_url, batch_max_in_flight=IN_FLIGHT, batch_poll_interval_s=0.001
    )
    redis = redis_client(settings)
    keys = RedisKeys()
    try:
        stored = await FileStore(redis, keys).save(
            owner=None,
            filename="in.jsonl",
            purpose=BATCH_PURPOSE,
            content=_input(lines).encode(),
            created_at=int(time.time()),
            ttl_s=3600,
        )
        batch = await BatchStore(redis, keys).create(
            owner=None,
            endpoint="/v1/embeddings",
            input_file_id=stored.id,
            completion_window="24h",
            window_s=86400,
            metadata=None,
        )
        lease = Lease(redis, keys.batch_lease(batch.id), settings.batch_lease_s)
        assert await lease.acquire()
        run = BatchRunner(redis, keys, settings, batch.id)
        most = 0

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, len(run.outstanding), len(run.input.parsed))
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        tracemalloc.start()
        try:
            assert await run.advance(time.monotonic() + 120, lease)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            watcher.cancel()
        return peak, most, await redis.hgetall(keys.batch(batch.id))
    finally:
        await redis.aclose()


def test_a_five_times_longer_batch_holds_about_the_same_memory_in_the_controller(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _ending_at_once(monkeypatch)
    small_peak, small_most, small = asyncio.run(_run_batch(redis_url, 1_000))
    large_peak, large_most, large = asyncio.run(_run_batch(redis_url, 5_000))
    assert small["status"] == large["status"] == "completed"
    assert (int(small["completed"]), int(large["completed"])) == (1_000, 5_000)
    assert small_most <= IN_FLIGHT and large_most <= IN_FLIGHT
    # 4,000 more lines: a controller that kept each line's output (~8 kB: its vector), its
    # parsed request or its job would be far past this bound (the input text, ~0.2 kB a line,
    # is within it)
    assert large_peak < 1.25 * small_peak, (small_peak, large_peak)
