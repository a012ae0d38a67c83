"""The worker's status scripts on a 3-primary cluster: each primary gets a script's text once,
then only its SHA1 (EVALSHA); a primary that forgot it (SCRIPT FLUSH, as a restart would) answers
NOSCRIPT, and the status change goes again whole at once, while the commands around it in the
pipeline (acks, chunks, batch announcements) are not sent twice. Under a running worker whose
primaries flush their scripts mid-run, every job still finishes exactly once."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from cluster_helpers import (
    MODEL,
    check_exactly_once,
    chunks_at_least,
    cluster_redis,
    cluster_settings,
    collect,
    enqueue_many,
)
from redis.asyncio import Redis
from worker_fakes import FakeEngine
from worker_harness import running_worker, wait_for

from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobStatus, RedisKeys
from schemas.jobs import new_job_id
from worker.publisher import Outbox

pytestmark = pytest.mark.anyio
GROUP_STREAM_MODEL = "m"


async def _on_primaries(cluster, *command: str) -> None:
    for node in cluster.primaries():
        redis = Redis(port=node.port)
        try:
            await redis.execute_command(*command)
        finally:
            await redis.aclose()


async def _calls(cluster) -> dict[int, Counter[str]]:
    """Per primary port: calls of EVAL and EVALSHA, and NOSCRIPT errors, since the last reset."""
    out: dict[int, Counter[str]] = {}
    for node in cluster.primaries():
        redis = Redis(port=node.port, decode_responses=True)
        try:
            stats = await redis.info("commandstats")
            errors = await redis.info("errorstats")
        finally:
            await redis.aclose()
        out[node.port] = Counter(
            eval=stats.get("cmdstat_eval", {}).get("calls", 0),
            evalsha=stats.get("cmdstat_evalsha", {}).get("calls", 0),
            noscript=errors.get("errorstat_NOSCRIPT", {}).get("count", 0),
        )
    return out


def _jobs_on_every_primary(cluster, keys: RedisKeys, per_primary: int) -> dict[str, int]:
    """Job ids whose keys lie on each primary (`per_primary` each) -> the primary's port."""
    wanted = {node.port: per_primary for node in cluster.primaries()}
    jobs: dict[str, int] = {}
    while any(wanted.values()):
        job = new_job_id()
        port = cluster.primary_of(keys.job(job)).port
        if wanted[port]:
            wanted[port] -= 1
            jobs[job] = port
    return jobs


async def _pending_entries(redis: Redis, keys: RedisKeys, jobs: list[str]) -> dict[str, str]:
    """A jobs-stream entry per job, delivered to a consumer (pending until acked)."""
    stream = keys.jobs_stream(GROUP_STREAM_MODEL)
    await redis.xgroup_create(stream, keys.group, id="0", mkstream=True)
    entries = {job: await redis.xadd(stream, {"job_id": job}) for job in jobs}
    await redis.xreadgroup(keys.group, "w", {stream: ">"})
    return entries


async def test_each_primary_gets_the_script_whole_once_then_by_evalsha(cluster_url, redis_cluster):
    redis = cluster_redis(cluster_url)
    keys = cluster_settings(cluster_url).redis_keys("inferq")
    outbox = Outbox(keys, keys.jobs_stream(GROUP_STREAM_MODEL), "w")
    jobs = _jobs_on_every_primary(redis_cluster, keys, per_primary=3)
    for job in jobs:
        await redis.hset(keys.job(job), "status", JobStatus.QUEUED.value)
    await _on_primaries(redis_cluster, "SCRIPT", "FLUSH")
    await _on_primaries(redis_cluster, "CONFIG", "RESETSTAT")
    done: list[tuple[bool, JobStatus | None]] = []
    for status in (JobStatus.RUNNING, JobStatus.SUCCEEDED):
        for job in jobs:
            outbox.transition(job, status, {}, lambda *reply: done.append(reply))
        await outbox.flush(redis)
    assert done == [(True, JobStatus.QUEUED)] * 9 + [(True, JobStatus.RUNNING)] * 9
    for job in jobs:
        assert await redis.hget(keys.job(job), "status") == JobStatus.SUCCEEDED.value
    calls = await _calls(redis_cluster)
    assert len(calls) == 3
    for counts in calls.values():  # 3 jobs a primary, two changes each: one whole, five by SHA
        assert counts == Counter(eval=1, evalsha=5)
    await redis.aclose()


async def test_a_primary_that_forgot_the_script_gets_it_again_and_nothing_runs_twice(
    cluster_url, redis_cluster
):
    redis = cluster_redis(cluster_url)
    keys = cluster_settings(cluster_url).redis_keys("inferq")
    outbox = Outbox(keys, keys.jobs_stream(GROUP_STREAM_MODEL), "w")
    jobs = _jobs_on_every_primary(redis_cluster, keys, per_primary=2)
    entries = await _pending_entries(redis, keys, list(jobs))
    for job in jobs:
        await redis.hset(keys.job(job), "status", JobStatus.QUEUED.value)
        outbox.transition(job, JobStatus.RUNNING, {})
    await outbox.flush(redis)  # every primary has run the script for this outbox
    await _on_primaries(redis_cluster, "SCRIPT", "FLUSH")  # as a restart would
    await _on_primaries(redis_cluster, "CONFIG", "RESETSTAT")

    done: dict[str, list[tuple[bool, JobStatus | None]]] = {job: [] for job in jobs}
    for job in jobs:  # status, then XACK + XDEL, then a command that is not idempotent
        outbox.finish(
            job,
            entries[job],
            JobStatus.SUCCEEDED,
            {},
            lambda *reply, job=job: done[job].append(reply),
        )
        outbox.announce_batch_end("b1", job)
    sent = await outbox.flush(redis)  # NOSCRIPT on every primary, re-sent whole at once
    assert sent == 3 * len(jobs) and len(outbox) == 0

    assert all(replies == [(True, JobStatus.RUNNING)] for replies in done.values()), done
    for job in jobs:
        assert await redis.hget(keys.job(job), "status") == JobStatus.SUCCEEDED.value
    announced = await redis.lrange(keys.batch_ended("b1"), 0, -1)
    assert sorted(announced) == sorted(jobs)  # each once: the pipeline was not re-sent
    stream = keys.jobs_stream(GROUP_STREAM_MODEL)
    assert (await redis.xpending(stream, keys.group))["pending"] == 0
    assert await redis.xlen(stream) == 0
    for counts in (await _calls(redis_cluster)).values():  # 2 jobs a primary
        assert counts == Counter(evalsha=2, noscript=2, eval=2)
    await redis.aclose()


async def test_scripts_flushed_on_every_primary_mid_run_every_job_finishes_once(
    cluster_url, redis_cluster
):
    jobs_count, tokens = 24, 40
    engine = FakeEngine(step_seconds=0.02)
    async with (
        AsyncRedisClient(cluster_settings(cluster_url)) as client,
        running_worker(cluster_url, engine, model=MODEL, redis_cluster=True) as worker,
    ):
        await _on_primaries(redis_cluster, "CONFIG", "RESETSTAT")
        jobs = await enqueue_many(client, jobs_count, max_tokens=tokens)
        streams = [asyncio.create_task(collect(client, job.id)) for job in jobs]
        await wait_for(lambda: chunks_at_least(client, jobs, 2), 60)
        await _on_primaries(redis_cluster, "SCRIPT", "FLUSH")  # the finishes meet NOSCRIPT
        streamed = await asyncio.wait_for(asyncio.gather(*streams), 120)
        done = [await client.wait(job.id, timeout=60) for job in jobs]
        assert worker.outcomes["succeeded"] == jobs_count
    for job, chunks in zip(done, streamed, strict=True):
        assert job.status is JobStatus.SUCCEEDED, job
        await check_exactly_once(client, job, chunks)
    calls = await _calls(redis_cluster)
    assert sum(c["noscript"] for c in calls.values()) > 0  # the fallback was exercised
    assert all(c["evalsha"] > 0 for c in calls.values())
    # the text went at most once a primary before the flush, once more a NOSCRIPT op after it
    assert sum(c["eval"] for c in calls.values()) <= 3 + sum(c["noscript"] for c in calls.values())


async def test_a_client_without_a_slot_map_yet_sends_the_script_whole(cluster_url, redis_cluster):
    keys = cluster_settings(cluster_url).redis_keys("inferq")
    job = new_job_id()
    setup = cluster_redis(cluster_url)
    await setup.hset(keys.job(job), "status", JobStatus.QUEUED.value)
    await setup.aclose()
    redis = cluster_redis(cluster_url)  # its first command is the flush's pipeline
    outbox = Outbox(keys, keys.jobs_stream(GROUP_STREAM_MODEL), "w")
    done: list[tuple[bool, JobStatus | None]] = []
    outbox.transition(job, JobStatus.RUNNING, {}, lambda *reply: done.append(reply))
    assert await outbox.flush(redis) == 1
    assert done == [(True, JobStatus.QUEUED)]
    assert await redis.hget(keys.job(job), "status") == JobStatus.RUNNING.value
    await redis.aclose()
