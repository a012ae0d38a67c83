"""Enqueue on a cluster: one atomic script where the job's partition stream is on its hash's
node, the single-slot steps where it is not; either way the job is stored queued, for good,
with the entry its stream holds, and the model's workers hear of it."""

from __future__ import annotations

import asyncio
import time
from unittest.mock import AsyncMock

import pytest
from cluster_helpers import MODEL, cluster_redis
from redis.exceptions import ResponseError

from producer_api import cluster_queue
from producer_api.queue import enqueue
from redis_io.pubsub import broadcast_pubsub
from schemas import JobField, JobRequest, JobStatus, RedisKeys
from schemas.jobs import as_text
from schemas.redis_scripts import CLUSTER_ENQUEUE_LOCAL_SCRIPT

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("partitions", [6, 4])  # 4 ranges do not line up with 3 shards
async def test_every_job_is_queued_whichever_node_its_partition_is_on(
    cluster_url, redis_cluster, partitions
):
    redis = cluster_redis(cluster_url)
    keys = RedisKeys(cluster=True, partitions=partitions)
    arrivals = await broadcast_pubsub(redis)
    await arrivals.subscribe(keys.arrivals_channel(MODEL))
    try:
        jobs = [
            await enqueue(redis, keys, JobRequest(model=MODEL, prompt=f"job {i}"))
            for i in range(24)
        ]
        together = 0
        for job in jobs:
            stream = keys.queue_stream(MODEL, 0, job.id)
            stored = await redis.hgetall(keys.job(job.id))
            assert as_text(stored[JobField.STATUS]) == JobStatus.QUEUED.value
            assert as_text(stored[JobField.ENTRY_ID]) == job.entry_id
            assert await redis.ttl(keys.job(job.id)) == -1  # no provisional TTL left
            [(entry, fields)] = await redis.xrange(stream, job.entry_id, job.entry_id)
            assert as_text(entry) == job.entry_id
            assert as_text(fields[b"job"] if b"job" in fields else fields["job"]) == job.id
            job_node = redis_cluster.primary_of(keys.job(job.id)).port
            together += job_node == redis_cluster.primary_of(stream).port
        heard = []
        while len(heard) < len(jobs):
            message = await asyncio.wait_for(arrivals.get_message(timeout=5), 10)
            if message is not None and message["type"] == "message":
                heard.append(as_text(message["data"]))
        assert sorted(heard) == sorted(job.entry_id for job in jobs)
        if partitions == 6:
            assert together >= len(jobs) - 1  # one script each (a range edge may split one)
        else:
            assert 0 < together < len(jobs)  # both paths taken
    finally:
        await arrivals.aclose()
        await redis.aclose()


@pytest.mark.parametrize("refused", ["script", "xadd"])  # the one-script path, the steps
async def test_a_node_refusing_the_write_leaves_no_job_and_a_retry_enqueues_at_once(
    cluster_url, monkeypatch, refused
):
    """Before the fix, the idempotency key outlived the refusal: a retry waited for a job
    that never came (the script) or got back a job stored but never queued (the steps)."""
    redis = cluster_redis(cluster_url)
    keys = RedisKeys(cluster=True, partitions=6)
    oom = ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
    real_run_script = cluster_queue.run_script
    job_keys: list[str] = []

    async def run_script(client, script, script_keys, args):
        job_keys.append(script_keys[0])
        if script == CLUSTER_ENQUEUE_LOCAL_SCRIPT:
            raise oom if refused == "script" else ResponseError(f"{cluster_queue.NOT_LOCAL}")
        return await real_run_script(client, script, script_keys, args)

    monkeypatch.setattr(cluster_queue, "run_script", run_script)
    if refused == "xadd":
        monkeypatch.setattr(redis, "xadd", AsyncMock(side_effect=oom))
    request = JobRequest(model=MODEL, prompt="pay", idempotency_key="order-1")
    try:
        with pytest.raises(ResponseError, match="OOM"):
            await enqueue(redis, keys, request, owner="alice")
        assert job_keys and not await redis.exists(job_keys[0])
        assert await redis.get(keys.idempotency("order-1", "alice")) is None
        monkeypatch.undo()
        started = time.monotonic()
        job = await enqueue(redis, keys, request, owner="alice")
        assert time.monotonic() - started < cluster_queue.RACING_JOB_WAIT_S
        stored = await redis.hgetall(keys.job(job.id))
        assert as_text(stored[JobField.STATUS]) == JobStatus.QUEUED.value
        assert as_text(stored[JobField.ENTRY_ID]) == job.entry_id
        again = await enqueue(redis, keys, request, owner="alice")
        assert again.id == job.id
    finally:
        await redis.aclose()
