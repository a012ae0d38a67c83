"""Workers on a 3-primary cluster split its shards: each takes its jobs from the partitions of
its home shard first, so its writes go to that shard (whose own keys the jobs sit on), and
every job still runs once."""

from __future__ import annotations

import contextlib
import time

import pytest
from cluster_helpers import MODEL, cluster_settings
from worker_fakes import FakeEngine
from worker_harness import running_worker, wait_for

from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobField, JobStatus
from schemas.jobs import as_text

pytestmark = pytest.mark.anyio

NAMES = ["home-a", "home-b", "home-c"]


async def test_three_workers_take_their_jobs_from_their_own_shard(cluster_url, redis_cluster):
    settings = cluster_settings(cluster_url)
    async with AsyncRedisClient(settings) as client, contextlib.AsyncExitStack() as stack:
        keys, redis = client.keys, client.redis
        # the workers know each other from their first heartbeat on
        await redis.zadd(keys.model_workers(MODEL), {name: time.time() for name in NAMES})
        jobs = [
            await client.enqueue(
                model=MODEL, prompt_token_ids=[9, i % 50 + 10], sampling={"max_tokens": 12}
            )
            for i in range(90)
        ]
        workers = [
            await stack.enter_async_context(
                running_worker(
                    cluster_url,
                    FakeEngine(step_seconds=0.01, max_num_seqs=4),
                    model=MODEL,
                    name=name,
                    redis_cluster=True,
                )
            )
            for name in NAMES
        ]

        async def all_done() -> bool:
            statuses = [await redis.hget(keys.job(job.id), JobField.STATUS) for job in jobs]
            return all(as_text(s or "") == JobStatus.SUCCEEDED.value for s in statuses)

        await wait_for(all_done, 120)
        streams = keys.jobs_streams(MODEL)
        ran_by = {
            job.id: as_text(await redis.hget(keys.job(job.id), JobField.WORKER) or "")
            for job in jobs
        }
        for worker in workers:
            assert worker.outcomes.get("succeeded", 0) == sum(
                1 for name in ran_by.values() if name == worker.name
            )
            assert worker.homes is not None and worker.homes.workers == NAMES
            home = {redis_cluster.primary_of(streams[k]).port for k in worker.homes.home(streams)}
            assert len(home) == 1  # three workers, three shards: one each
            mine = [job_id for job_id, name in ran_by.items() if name == worker.name]
            at_home = [j for j in mine if redis_cluster.primary_of(keys.job(j)).port in home]
            # the first read of each may come before it knew its home; the rest are home
            # jobs until its home shard ran dry, then it helps the others
            assert len(at_home) >= 0.6 * len(mine), (worker.name, len(at_home), len(mine))
        for stream in streams:
            assert await redis.xlen(stream) == 0
