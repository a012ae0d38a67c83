"""Scale-out (slow): two real workers on the default model share one model's backlog through
the consumer group, and when one is SIGKILLed mid-generation the other takes over its jobs:
every job ends once, with the uninterrupted greedy text, and every chunk number is delivered
exactly once (no gap, no duplicate) in the replay stream and to the streaming client."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from worker_harness import (
    KEYS,
    LiveTap,
    check_delivery,
    start_worker_process,
    stop_process,
    stream_all,
    wait_for,
)

from engine import SamplingParams
from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobStatus

pytestmark = [pytest.mark.anyio, pytest.mark.model, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
JOBS = 16
MAX_TOKENS = 32
SEQS_PER_WORKER = 4  # so neither worker can take the whole backlog at once
PARAMS = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def _prompts() -> list[str]:
    return [f"Describe city number {i} and its {'bridges ' * (1 + i % 4)}" for i in range(JOBS)]


async def _jobs_by_worker(redis: Redis, job_ids: list[str], status: JobStatus) -> dict[str, int]:
    counts: dict[str, int] = {}
    for job_id in job_ids:
        worker, current = await redis.hmget(KEYS.job(job_id), ["worker", "status"])
        if current == status.value and worker:
            counts[worker] = counts.get(worker, 0) + 1
    return counts


async def test_two_workers_share_a_backlog_and_survive_a_sigkill(redis_url, smollm):
    prompts = _prompts()
    outputs = smollm.generate(prompts, SamplingParams(**PARAMS), use_tqdm=False)
    expected = [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]
    env = {"INFERQ_NUM_THREADS": "1"}  # two engines on a small machine: one core each
    workers = {
        name: start_worker_process(
            redis_url,
            fake=False,
            model=MODEL,
            name=name,
            max_num_seqs=SEQS_PER_WORKER,
            extra_env=env,
        )
        for name in ("keeper", "victim")
    }
    redis = Redis.from_url(redis_url, decode_responses=True)
    try:
        # Both engines loaded and beating before the backlog arrives.
        for name in workers:
            await wait_for(lambda n=name: redis.exists(KEYS.worker(n)), 300, 0.2)
        async with AsyncRedisClient(redis_url) as client, LiveTap(redis) as tap:
            jobs = [
                await client.enqueue(model=MODEL, prompt=p, stream=True, sampling=PARAMS)
                for p in prompts
            ]
            ids = [job.id for job in jobs]
            streams = [asyncio.create_task(stream_all(client, job.id)) for job in jobs]

            async def victim_mid_batch() -> bool:
                done = await _jobs_by_worker(redis, ids, JobStatus.SUCCEEDED)
                running = await _jobs_by_worker(redis, ids, JobStatus.RUNNING)
                return done.get("victim", 0) >= 1 and running.get("victim", 0) >= 1

            await wait_for(victim_mid_batch, 300, 0.05)
            workers["victim"].kill()
            workers["victim"].wait()
            killed_running = (await _jobs_by_worker(redis, ids, JobStatus.RUNNING)).get("victim")
            assert killed_running, "the victim held no running job when it was killed"

            streamed = await asyncio.wait_for(asyncio.gather(*streams), 300)
            done = [await client.wait(job_id, timeout=120) for job_id in ids]
        assert all(job.status is JobStatus.SUCCEEDED for job in done)
        finishers = {job.worker for job in done}
        assert finishers == {"keeper", "victim"}, "both workers finished jobs"
        retried = [job for job in done if job.attempts > 1]
        assert retried and all(job.worker == "keeper" for job in retried)
        for job, chunks, want in zip(done, streamed, expected, strict=True):
            await check_delivery(redis, job, chunks, tap.chunks.get(job.id, []), want)
        # Every entry acked and deleted: nothing queued, nothing pending.
        assert await redis.xlen(KEYS.jobs_stream(MODEL)) == 0
        (group,) = await redis.xinfo_groups(KEYS.jobs_stream(MODEL))
        assert group["pending"] == 0
    finally:
        for process in workers.values():
            if process.poll() is None:
                stop_process(process)
        await redis.aclose()
