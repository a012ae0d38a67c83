"""Enqueue on a cluster: one atomic script where the job's partition stream is on its hash's
node, the single-slot steps where it is not; either way the job is stored queued, for good,
with the entry its stream holds, and the model's workers hear of it."""

from __future__ import annotations

import asyncio

import pytest
from cluster_helpers import MODEL, cluster_redis

from producer_api.queue import enqueue
from redis_io.pubsub import broadcast_pubsub
from schemas import JobField, JobRequest, JobStatus, RedisKeys
from schemas.jobs import as_text

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
