"""The queue's guarantees on a 3-primary Redis Cluster with replicas: a killed worker's jobs
resume exactly once, a stopped worker hands its jobs back, cancel, dead letters, and the
operator's view of every shard."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest
from cluster_helpers import (
    MODEL,
    check_exactly_once,
    chunks_at_least,
    cluster_settings,
    collect,
    enqueue_many,
    kill_a_worker_once,
)
from worker_fakes import FakeEngine
from worker_harness import running_worker, start_slow_fake_worker, stop_process, wait_for

from producer_api.client.redis_client import AsyncRedisClient
from producer_api.load import read_load
from producer_api.status import read_snapshot
from producer_api.system_metrics import SystemMetrics
from schemas import ErrorCode, Job, JobRequest, JobStatus

pytestmark = pytest.mark.anyio


async def test_a_killed_workers_jobs_resume_exactly_once(cluster_url):
    async with AsyncRedisClient(cluster_settings(cluster_url)) as client:
        jobs = await enqueue_many(client, 12, max_tokens=40)
        streams = [asyncio.create_task(collect(client, job.id)) for job in jobs]
        await kill_a_worker_once(cluster_url, lambda: chunks_at_least(client, jobs, 5))
        assert not await chunks_at_least(client, jobs, 40)  # killed mid-generation
        async with running_worker(
            cluster_url, FakeEngine(), model=MODEL, name="rescuer", redis_cluster=True
        ) as rescuer:
            streamed = await asyncio.wait_for(asyncio.gather(*streams), 60)
            done = [await client.wait(job.id, timeout=30) for job in jobs]
        assert rescuer.outcomes["succeeded"] == 12
        for job, chunks in zip(done, streamed, strict=True):
            assert job.status is JobStatus.SUCCEEDED and job.worker == "rescuer"
            assert job.attempts == 2
            await check_exactly_once(client, job, chunks)


async def test_a_stopped_worker_hands_its_jobs_back_across_shards(cluster_url):
    async with AsyncRedisClient(cluster_settings(cluster_url)) as client:
        jobs = await enqueue_many(client, 8, max_tokens=60)
        streams = [asyncio.create_task(collect(client, job.id)) for job in jobs]
        leaving = start_slow_fake_worker(
            cluster_url, MODEL, "leaving", drain_timeout_s=0.3, redis_cluster=True
        )
        try:
            await wait_for(lambda: chunks_at_least(client, jobs, 5), 60)
        finally:
            code = await asyncio.to_thread(stop_process, leaving, signal.SIGTERM, 30)
        assert code == 0, leaving.stdout
        keys = client.keys
        assert await client.redis.xlen(keys.jobs_stream(MODEL)) >= 0
        assert sum([await client.redis.xlen(s) for s in keys.jobs_streams(MODEL)]) == 8
        async with running_worker(
            cluster_url,
            FakeEngine(),
            model=MODEL,
            name="heir",
            claim_min_idle_ms=60_000,
            redis_cluster=True,
        ):
            streamed = await asyncio.wait_for(asyncio.gather(*streams), 30)
            done = [await client.wait(job.id, timeout=30) for job in jobs]
        for job, chunks in zip(done, streamed, strict=True):
            assert job.status is JobStatus.SUCCEEDED and job.worker == "heir"
            assert job.attempts == 1  # a graceful hand-back is no failed attempt
            await check_exactly_once(client, job, chunks)


async def test_cancel_reaches_the_worker_and_clears_the_backlog(cluster_url):
    engine = FakeEngine(step_seconds=0.05)
    # no status polling within the test: only the cancel broadcast can stop the job
    async with (
        AsyncRedisClient(cluster_settings(cluster_url)) as client,
        running_worker(
            cluster_url, engine, model=MODEL, redis_cluster=True, status_check_interval_s=60
        ) as worker,
    ):
        job = await client.enqueue(
            model=MODEL, prompt_token_ids=[15] * 40, stream=True, sampling={"max_tokens": 400}
        )
        await wait_for(lambda: chunks_at_least(client, [job], 3))
        cancelled = await client.cancel(job.id)
        assert cancelled.status is JobStatus.CANCELLED
        stream = client.keys.queue_stream(MODEL, 0, job.id)
        assert await client.redis.xlen(stream) == 0  # off the backlog at once
        await wait_for(lambda: not worker.batch.all_jobs(), 5)  # the broadcast reached it
        await wait_for(lambda: _nothing_pending(client, stream), 5)
        final = await client.get(job.id)
        assert final.status is JobStatus.CANCELLED and final.error.code is ErrorCode.CANCELLED
        chunks = await asyncio.wait_for(collect(client, job.id), 10)  # the stream ends
        assert len(chunks) < 400


async def test_an_idle_worker_hears_of_a_new_job_on_any_partition(cluster_url):
    # Blocked reads could watch one partition only: the arrivals broadcast wakes the worker.
    async with (
        AsyncRedisClient(cluster_settings(cluster_url)) as client,
        running_worker(cluster_url, FakeEngine(), model=MODEL, redis_cluster=True, block_ms=10_000),
    ):
        await asyncio.sleep(1.0)  # the worker is idle, waiting
        for i in range(6):
            job = await client.enqueue(
                model=MODEL, prompt_token_ids=[40 + i], sampling={"max_tokens": 2}
            )
            started = asyncio.get_running_loop().time()
            assert (await client.wait(job.id, timeout=20)).status is JobStatus.SUCCEEDED
            assert asyncio.get_running_loop().time() - started < 3.0  # not a 10 s wait


async def _nothing_pending(client: AsyncRedisClient, stream: str) -> bool:
    return (await client.redis.xpending(stream, "workers"))["pending"] == 0


async def test_poison_is_dead_lettered_and_good_jobs_go_on(cluster_url):
    async with AsyncRedisClient(cluster_settings(cluster_url)) as client:
        redis, keys = client.redis, client.keys
        good = await enqueue_many(client, 4, max_tokens=6)
        garbage_stream = keys.jobs_stream(MODEL, 1)
        await redis.xadd(garbage_stream, {"garbage": "yes"})
        too_often = Job.new(JobRequest(model=MODEL, prompt="again"))
        stream = keys.queue_stream(MODEL, 0, too_often.id)
        entry = await redis.xadd(stream, {"job": too_often.id})
        fields = {**too_often.to_redis_hash(), "entry_id": entry, "attempts": "3"}
        await redis.hset(keys.job(too_often.id), mapping=fields)
        async with running_worker(cluster_url, FakeEngine(), model=MODEL, redis_cluster=True):
            done = [await client.wait(job.id, timeout=20) for job in good]
            assert all(job.status is JobStatus.SUCCEEDED for job in done)
            failed = await client.wait(too_often.id, timeout=20)
            assert failed.status is JobStatus.FAILED
            assert failed.error.code is ErrorCode.MAX_ATTEMPTS_EXCEEDED
            letters = await _wait_for_letters(client, 2)
        reasons = {_text(f[b"job"]): _text(f[b"reason"]) for _, f in letters}
        assert reasons == {"": "unparseable_job", too_often.id: "max_attempts_exceeded"}
        garbage = next(f for _, f in letters if _text(f[b"job"]) == "")
        assert json.loads(garbage[b"entry"]) == {"garbage": "yes"}


async def _wait_for_letters(client: AsyncRedisClient, count: int) -> list:
    stream = client.keys.dead_letters(MODEL)
    await wait_for(lambda: _length_is(client, stream, count), 10)
    return await client.redis.xrange(stream, "-", "+")


async def _length_is(client: AsyncRedisClient, stream: str, count: int) -> bool:
    return await client.redis.xlen(stream) >= count


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def test_the_operators_view_counts_every_shard(cluster_url):
    async with AsyncRedisClient(cluster_settings(cluster_url)) as client:
        jobs = await enqueue_many(client, 30, max_tokens=4)
        load = await read_load(client.redis, client.keys)
        (model,) = load.models()
        assert model.name == MODEL and model.queued == 30  # every partition, on every shard
        assert await _metric(client, "inferq_queue_length") == 30  # /metrics: the same
        async with running_worker(
            cluster_url, FakeEngine(), model=MODEL, name="seen", redis_cluster=True
        ):
            for job in jobs:
                await client.wait(job.id, timeout=30)
            load = await read_load(client.redis, client.keys)
            assert [w.name for w in load.workers] == ["seen"]
            assert load.models()[0].queued == 0
            # `inferq status` / the dashboard, and /metrics, read the same across the shards
            await wait_for(lambda: _tokens_seen(client), 10)
            snapshot = await read_snapshot(client.redis, client.keys)
            assert [w.name for w in snapshot.workers] == ["seen"]
            (view,) = snapshot.models
            assert view.name == MODEL
            assert await _metric(client, "inferq_queue_length") == 0


async def _metric(client: AsyncRedisClient, name: str) -> float:
    """`name`'s value for the model on /metrics; each label set once (partitions merged)."""
    metrics = SystemMetrics()
    await metrics.refresh(client.redis, client.keys)
    samples = [s for family in metrics.collect() for s in family.samples]
    labelled = [(s.name, tuple(sorted(s.labels.items()))) for s in samples]
    assert len(labelled) == len(set(labelled))
    (value,) = [s.value for s in samples if s.name == name and s.labels.get("model") == MODEL]
    return value


async def _tokens_seen(client: AsyncRedisClient) -> bool:
    return await client.redis.zcard(client.keys.token_samples(MODEL)) > 0
