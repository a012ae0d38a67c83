"""Admission on a 3-primary Redis Cluster: an idempotency key makes one job however often (and
however concurrently) it is sent, though the key and its job sit on different shards; deadlines
drop a job that expired in the queue, with its code, and stop one that runs past its deadline."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from cluster_helpers import MODEL, cluster_settings
from worker_fakes import FakeEngine
from worker_harness import running_worker, wait_for

from producer_api.client.redis_client import AsyncRedisClient
from producer_api.queue import QueueFullError, queue_length
from schemas import ErrorCode, Job, JobRequest, JobStatus, utc_now

pytestmark = pytest.mark.anyio


async def test_an_idempotency_key_makes_one_job(cluster_url, redis_cluster):
    async with AsyncRedisClient(cluster_settings(cluster_url), owner="alice") as client:
        keys = client.keys
        jobs = {}
        for i in range(6):
            key = f"order-{i}"
            first = await client.enqueue(model=MODEL, prompt="pay", idempotency_key=key)
            again = await client.enqueue(model=MODEL, prompt="pay", idempotency_key=key)
            assert again.id == first.id
            jobs[key] = first
        # the guarantee holds where the key's shard is not its job's
        assert any(
            redis_cluster.primary_of(keys.idempotency(key, "alice")).port
            != redis_cluster.primary_of(keys.job(job.id)).port
            for key, job in jobs.items()
        )
        assert await queue_length(client.redis, keys, MODEL) == 6
    async with AsyncRedisClient(cluster_settings(cluster_url), owner="bob") as other:
        theirs = await other.enqueue(model=MODEL, prompt="pay", idempotency_key="order-0")
        assert theirs.id != jobs["order-0"].id  # keys are per owner


async def test_concurrent_enqueues_with_one_idempotency_key_make_one_job(cluster_url):
    async with AsyncRedisClient(cluster_settings(cluster_url)) as client:
        for round_ in range(3):
            jobs = await asyncio.gather(
                *(
                    client.enqueue(model=MODEL, prompt="once", idempotency_key=f"same-{round_}")
                    for _ in range(20)
                )
            )
            assert len({job.id for job in jobs}) == 1
        assert await queue_length(client.redis, client.keys, MODEL) == 3


async def test_an_enqueue_that_loses_the_key_race_waits_for_the_winners_job(cluster_url):
    async with AsyncRedisClient(cluster_settings(cluster_url), owner="alice") as client:
        keys = client.keys
        winner = Job.new(JobRequest(model=MODEL, prompt="pay"), owner="alice")
        # the winner's SET NX landed; its job hash is one round trip behind
        await client.redis.set(keys.idempotency("order-7", "alice"), winner.id)
        loser = asyncio.create_task(
            client.enqueue(model=MODEL, prompt="pay", idempotency_key="order-7")
        )
        await asyncio.sleep(0.2)
        await client.redis.hset(keys.job(winner.id), mapping=winner.to_redis_hash())
        assert (await loser).id == winner.id
        assert await queue_length(client.redis, keys, MODEL) == 0  # no second job queued


async def test_a_refused_enqueue_leaves_its_idempotency_key_free(cluster_url):
    settings = cluster_settings(cluster_url)
    async with AsyncRedisClient(settings, owner="alice", max_queue_len=1) as client:
        await client.enqueue(model=MODEL, prompt="first")
        with pytest.raises(QueueFullError):
            await client.enqueue(model=MODEL, prompt="pay", idempotency_key="order-9")
        async with running_worker(cluster_url, FakeEngine(), model=MODEL, redis_cluster=True):
            await wait_for(lambda: _backlog_is(client, 0), 20)
        retried = await client.enqueue(model=MODEL, prompt="pay", idempotency_key="order-9")
        assert (await client.get(retried.id)).status is JobStatus.QUEUED


async def _backlog_is(client: AsyncRedisClient, count: int) -> bool:
    return await queue_length(client.redis, client.keys, MODEL) == count


async def test_deadlines_drop_an_expired_job_and_stop_a_late_one(cluster_url):
    async with AsyncRedisClient(cluster_settings(cluster_url)) as client:
        stale = await client.enqueue(model=MODEL, prompt_token_ids=[7, 8], timeout_s=0.2)
        await asyncio.sleep(0.4)
        engine = FakeEngine(step_seconds=0.02)
        async with running_worker(cluster_url, engine, model=MODEL, redis_cluster=True):
            expired = await client.wait(stale.id, timeout=15)
            assert expired.status is JobStatus.EXPIRED, expired
            assert expired.error.code is ErrorCode.EXPIRED
            assert await client.redis.xlen(client.keys.out_stream(stale.id)) == 0  # never ran
            late = await client.enqueue(
                model=MODEL,
                prompt_token_ids=[16] * 8,
                stream=True,
                deadline=utc_now() + timedelta(seconds=0.6),
                sampling={"max_tokens": 500},
            )
            over = await client.wait(late.id, timeout=15)
            assert over.status is JobStatus.EXPIRED, over
            assert over.error.code is ErrorCode.DEADLINE_EXCEEDED
            produced = await client.redis.xlen(client.keys.out_stream(late.id))
            assert 0 < produced < 500
        assert await queue_length(client.redis, client.keys, MODEL) == 0  # both entries acked
