"""Soak (slow): two worker processes, one of them SIGKILLed every 5-8 s and restarted, and every
job still finishes, streamed exactly once: a worker's death the jobs did not cause fails none of
them, however often they ride along (fake engine in real worker processes, real Redis)."""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import subprocess

import pytest
from redis.asyncio import Redis
from worker_fakes import expected_output
from worker_harness import check_delivery, start_slow_fake_worker, stop_process, stream_all

from producer_api.client.redis_client import AsyncRedisClient
from schemas import TERMINAL_STATUSES, Job, JobStatus

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
logger = logging.getLogger(__name__)
MODEL = "fake-model"
JOBS, MAX_TOKENS = 48, 120  # ~5 s of generation each, 8 at a time per worker
KILL_EVERY_S = (5.0, 8.0)
GIVE_UP_S = 150.0


async def _all_ended(client: AsyncRedisClient, jobs: list[Job]) -> bool:
    statuses = [(await client.get(job.id)).status for job in jobs]
    return all(status in TERMINAL_STATUSES for status in statuses)


async def test_jobs_finish_while_a_worker_is_sigkilled_every_5_to_8_seconds(redis_url):
    rng = random.Random(7)
    redis = Redis.from_url(redis_url, decode_responses=True)
    names = iter(f"w{n}" for n in range(1000))

    def start() -> subprocess.Popen[bytes]:
        return start_slow_fake_worker(
            redis_url, MODEL, next(names), step_seconds=0.04, max_num_seqs=8
        )

    async with AsyncRedisClient(redis_url) as client:
        jobs = [
            await client.enqueue(
                model=MODEL,
                prompt_token_ids=[100 + i, 5, 6],
                stream=i % 2 == 0,
                sampling={"max_tokens": MAX_TOKENS},
            )
            for i in range(JOBS)
        ]
        streams = {
            job.id: asyncio.create_task(stream_all(client, job.id))
            for job in jobs
            if job.request.stream
        }
        workers = [start(), start()]
        kills = 0
        loop = asyncio.get_running_loop()
        give_up = loop.time() + GIVE_UP_S
        try:
            while not await _all_ended(client, jobs):
                assert loop.time() < give_up, f"jobs still running after {kills} kills"
                await asyncio.sleep(rng.uniform(*KILL_EVERY_S))
                victim = rng.randrange(len(workers))
                workers[victim].send_signal(signal.SIGKILL)
                workers[victim].wait()
                kills += 1
                workers[victim] = start()
        finally:
            for worker in workers:
                await asyncio.to_thread(stop_process, worker, signal.SIGKILL, 10)
        done = [await client.get(job.id) for job in jobs]
        failed = {job.id: job.error for job in done if job.status is not JobStatus.SUCCEEDED}
        assert not failed, f"{len(failed)} jobs failed after {kills} kills: {failed}"
        assert kills >= 4
        cut_off = sum(job.attempts - 1 for job in done)
        logger.info(
            "%d kills, %d cut-off starts, most starts of one job %d",
            kills,
            cut_off,
            max(job.attempts for job in done),
        )
        assert cut_off >= kills  # each kill cut jobs off mid-run: they did ride along
        for job in done:
            want = expected_output(job.request.prompt_token_ids, MAX_TOKENS)
            assert job.result.choices[0].token_ids == want[0]
            if job.request.stream:
                streamed = await asyncio.wait_for(streams[job.id], 10)
                await check_delivery(redis, job, streamed, None, want)
    await redis.aclose()
