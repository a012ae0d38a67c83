"""Soak (slow): the default model in two worker processes, one of them SIGKILLed every 5-8 s
and restarted, 20 times, while 60 streaming jobs arrive, 3 per interval. The victim is a worker
that is up and serving and, where one does, holds jobs, so that a kill cuts jobs off however
long a restart takes on a busy machine and however fast jobs finish on a quiet one; when both
were restarting, the next kill comes 5-8 s after one is up again. Every job finishes exactly
once with the greedy text of a run without kills: deaths the jobs did not cause fail none of
them, however often they ride along or were just admitted. A job that kills every worker running
it is dead-lettered after `max_attempts` crashes it alone explains (worker.crashes; real
Redis)."""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import subprocess
import time
from dataclasses import dataclass

import pytest
from poison_engine import POISON_EXIT, POISON_PROMPT_ENV
from real_model_jobs import MODEL, greedy_params, note_prompts, reference
from redis.asyncio import Redis
from worker_harness import KEYS, check_delivery, start_worker_process, stop_process, stream_all

from producer_api.client.redis_client import AsyncRedisClient
from schemas import TERMINAL_STATUSES, ErrorCode, Job, JobStatus
from schemas.keys import DEFAULT_MAX_ATTEMPTS

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.model]
logger = logging.getLogger(__name__)
JOBS, MAX_TOKENS = 60, 96
KILLS = 20
KILL_EVERY_S = (5.0, 8.0)
POISON_AT_KILL = 4  # the poison job arrives with the jobs of this interval
POISON_PROMPT = "This request crashes whichever worker runs it."
GIVE_UP_S = 1200.0


@dataclass
class Worker:
    name: str
    process: subprocess.Popen[bytes]


async def _ended(client: AsyncRedisClient, jobs: list[Job]) -> bool:
    statuses = [(await client.get(job.id)).status for job in jobs]
    return all(status in TERMINAL_STATUSES for status in statuses)


# Quick starts: 20 restarts must not each compile the forward or measure kernels (the start-up
# tuning is tested elsewhere); the reference runs with the same settings, so the same kernels.
QUICK_START = dict(dtype="float32", enforce_eager=True, cpu_matmul="aten", cpu_greedy_screen="off")


async def test_60_jobs_on_the_real_model_while_a_worker_is_sigkilled_20_times(redis_url):
    from engine import LLM

    prompts = note_prompts(JOBS)
    offline = LLM(MODEL, **QUICK_START)
    expected = dict(zip(prompts, reference(offline, prompts, MAX_TOKENS), strict=True))
    del offline
    rng = random.Random(7)
    redis = Redis.from_url(redis_url, decode_responses=True)
    names = iter(f"w{n}" for n in range(1000))

    def start() -> Worker:
        name = next(names)
        return Worker(
            name,
            start_worker_process(
                redis_url,
                fake=False,
                model=MODEL,
                name=name,
                engine_factory="poison_engine:build_engine",
                extra_env={POISON_PROMPT_ENV: POISON_PROMPT},
                **QUICK_START,
            ),
        )

    per_interval = -(-JOBS // KILLS)
    jobs: list[Job] = []
    streams: dict[str, asyncio.Task] = {}
    poison: Job | None = None
    kills = own_deaths = 0
    started = time.monotonic()
    async with AsyncRedisClient(redis_url) as client:
        workers = [start(), start()]

        def restart_the_dead() -> None:
            nonlocal own_deaths
            for i, worker in enumerate(workers):
                if worker.process.poll() is not None:
                    log = worker.process.log_path.read_text()[-3000:]
                    assert worker.process.returncode == POISON_EXIT, log
                    own_deaths += 1
                    workers[i] = start()

        async def serving() -> list[int]:
            """The workers up and serving (their heartbeat is there): a kill cuts jobs off."""
            return [
                i
                for i, w in enumerate(workers)
                if w.process.poll() is None and await redis.exists(KEYS.worker(w.name))
            ]

        async def holding(up: list[int]) -> list[int]:
            """Of the serving workers, those holding jobs (pending entries) now."""
            summary = await redis.xpending(KEYS.jobs_stream(MODEL), KEYS.group)
            busy = {c["name"] for c in summary["consumers"] if int(c["pending"]) > 0}
            return [i for i in up if workers[i].name in busy]

        try:
            while kills < KILLS or not await _ended(client, [*jobs, *([poison] if poison else [])]):
                assert time.monotonic() - started < GIVE_UP_S, f"still running after {kills} kills"
                while len(jobs) < min(JOBS, (kills + 1) * per_interval):  # 3 per interval
                    job = await client.enqueue(
                        model=MODEL,
                        prompt=prompts[len(jobs)],
                        stream=True,
                        sampling=greedy_params(MAX_TOKENS),
                    )
                    jobs.append(job)
                    streams[job.id] = asyncio.create_task(stream_all(client, job.id))
                if kills == POISON_AT_KILL and poison is None:
                    poison = await client.enqueue(
                        model=MODEL, prompt=POISON_PROMPT, sampling=greedy_params(MAX_TOKENS)
                    )
                gap = rng.uniform(*KILL_EVERY_S) if kills < KILLS else 1.0
                wake = time.monotonic() + gap
                up: list[int] = []
                while time.monotonic() < wake or (kills < KILLS and not up):
                    restart_the_dead()
                    await asyncio.sleep(0.1)
                    up = await serving() if kills < KILLS else []
                    if kills < KILLS and not up:
                        # both restarting: the next kill comes `gap` after one is up again, not
                        # the moment it is (a kill timed to a worker's first step every time)
                        wake = time.monotonic() + gap
                if kills < KILLS:
                    # the one holding jobs, where one does: on a fast machine an interval's jobs
                    # may all be done by then, and a kill must cut jobs off to prove anything
                    victim = workers[rng.choice(await holding(up) or up)]
                    if victim.process.poll() is not None:
                        continue  # it died on its own meanwhile: restarted next turn
                    victim.process.send_signal(signal.SIGKILL)
                    victim.process.wait()
                    kills += 1
                    workers[workers.index(victim)] = start()
                else:
                    restart_the_dead()
        finally:
            for worker in workers:
                await asyncio.to_thread(stop_process, worker.process, signal.SIGKILL, 10)
        elapsed = time.monotonic() - started
        done = [await client.get(job.id) for job in jobs]
        failed = {job.id: job.error for job in done if job.status is not JobStatus.SUCCEEDED}
        assert not failed, f"{len(failed)} jobs failed after {kills} kills: {failed}"
        cut_off = sum(job.attempts - 1 for job in done)
        logger.warning(
            "soak: %d jobs, %d kills and %d poison deaths in %.0f s; %d cut-off starts, "
            "%d charged, most starts of one job %d",
            len(done),
            kills,
            own_deaths,
            elapsed,
            cut_off,
            sum(job.attempts - 1 - job.crash_resumes for job in done),
            max(job.attempts for job in done),
        )
        assert kills == KILLS and len(done) == JOBS
        assert cut_off >= KILLS // 2  # the kills did cut jobs off mid-run
        for job in done:
            streamed = await asyncio.wait_for(streams[job.id], 30)
            await check_delivery(redis, job, streamed, None, expected[job.request.prompt])
        assert poison is not None
        dead = await client.get(poison.id)
        assert dead.status is JobStatus.FAILED
        assert dead.error.code is ErrorCode.MAX_ATTEMPTS_EXCEEDED
        assert dead.attempts - dead.crash_resumes == DEFAULT_MAX_ATTEMPTS
        # each charged start was its own crash; its first may have been shared with the jobs
        # that arrived with it (a suspect then, not charged)
        assert DEFAULT_MAX_ATTEMPTS <= own_deaths <= DEFAULT_MAX_ATTEMPTS + 1
        letters = await redis.xrange(KEYS.dead_letters(MODEL), "-", "+")
        assert [fields["job"] for _, fields in letters] == [poison.id]
    await redis.aclose()
