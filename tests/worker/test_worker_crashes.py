"""Worker deaths a job did not cause do not fail it; a job that keeps killing its workers is
dead-lettered within `max_attempts` deaths (the rule in worker.crashes; real Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal

import pytest
from redis.asyncio import Redis
from worker_fakes import FakeEngine, expected_output
from worker_harness import (
    KEYS,
    check_delivery,
    replay_chunks,
    running_worker,
    settings_for,
    start_slow_fake_worker,
    wait_for,
)

from producer_api.client.redis_client import AsyncRedisClient
from schemas import (
    TERMINAL_STATUSES,
    ErrorCode,
    Job,
    JobRequest,
    JobStatus,
    RedisKeys,
    RunState,
    TokenChunk,
    chunk_stream_id,
    utc_now,
)
from schemas.chunks import REPLAY_FIELD
from worker.batch import Batch
from worker.chunking import ChunkPolicy
from worker.crashes import CrashPolicy, FirstStep, settle_cut_off_start
from worker.held import HeldJob
from worker.metrics import WorkerMetrics
from worker.publisher import Outbox
from worker.tracing import ChunkTracer
from worker.worker import Worker

pytestmark = pytest.mark.anyio
MODEL = "fake-model"
POLICY = CrashPolicy(max_attempts=3, max_crash_resumes=4)
POISON_TOKEN = 999


def _held(attempts: int = 0, run: RunState | None = None, crash_resumes: int = 0) -> HeldJob:
    job = Job.new(JobRequest(model=MODEL, prompt_token_ids=[11, 12]))
    job = job.model_copy(
        update={"attempts": attempts, "run_state": run, "crash_resumes": crash_resumes}
    )
    return HeldJob.fresh(job, "1-0")


STARTED, PROGRESSED = RunState.STARTED, RunState.PROGRESSED
OUT, SHARED, ALONE = FirstStep.OUTSIDE, FirstStep.SHARED, FirstStep.ALONE
# (attempts, how far the last start got, crash_resumes, reclaimed, where it stood in the dead
# worker's first-step marker) -> (dead-lettered, quarantined, crash_resumes to store)
RULE = {
    "fresh job": ((0, None, 0, False, OUT), (False, False, 0)),
    "progressed, then its worker died": ((1, PROGRESSED, 0, True, OUT), (False, False, 1)),
    "progressed (a marker not yet deleted)": ((1, PROGRESSED, 0, True, ALONE), (False, False, 1)),
    "many deaths, each after progress": ((4, PROGRESSED, 3, True, OUT), (False, False, 4)),
    "past the bound on forgiven deaths": ((5, PROGRESSED, 4, True, OUT), (True, False, 5)),
    "its worker died in its first step": ((1, STARTED, 0, True, ALONE), (False, True, 0)),
    "second death in its first step": ((2, STARTED, 0, True, ALONE), (False, True, 0)),
    "third death in its first step": ((3, STARTED, 0, True, ALONE), (True, True, 0)),
    "no output yet, but not in the step its worker died in": (
        (1, STARTED, 0, True, OUT),
        (False, False, 1),
    ),
    "three starts without output, never in the fatal step": (
        (3, STARTED, 2, True, OUT),
        (False, False, 3),
    ),
    "past the bound, deaths outside its first step": (
        (5, STARTED, 4, True, OUT),
        (True, False, 5),
    ),
    "died in its first step, charged starts below the limit": (
        (5, STARTED, 3, True, ALONE),
        (False, True, 3),
    ),
    "its worker died in a first step it shared": ((1, STARTED, 0, True, SHARED), (False, True, 1)),
    "a suspect again, then alone": ((2, STARTED, 1, True, ALONE), (False, True, 1)),
    "shared deaths past the bound on forgiven deaths": (
        (5, STARTED, 4, True, SHARED),
        (True, True, 5),
    ),
    "taken over before its start was stored": ((0, None, 0, True, OUT), (False, True, 0)),
    "handed back (start ended), not charged": ((1, None, 0, False, OUT), (False, False, 0)),
    "started too often (no crash record)": ((3, None, 0, False, OUT), (True, False, 0)),
}


@pytest.mark.parametrize("case", list(RULE))
def test_cut_off_starts_are_charged_only_when_the_worker_died_in_their_first_step(case):
    (attempts, run, resumes, reclaimed, marked), expected = RULE[case]
    held = _held(attempts, run, resumes)
    error = settle_cut_off_start(held, reclaimed, marked, POLICY)
    assert (error is not None, held.quarantined, held.crash_resumes) == expected
    if error is not None:
        assert error.code is ErrorCode.MAX_ATTEMPTS_EXCEEDED


def test_a_quarantined_job_joins_as_the_only_newcomer_and_alone_until_it_progresses():
    engine = FakeEngine()
    batch = Batch(
        engine,
        Outbox(RedisKeys(), KEYS.jobs_stream(MODEL), "w"),
        worker_name="w",
        policy=ChunkPolicy(1, 0.0),
        metrics=WorkerMetrics(MODEL),
        tracer=ChunkTracer(None),
        prompt_estimate=8,
    )

    def step() -> None:
        batch.collect(engine.step(), None, 0.0)

    running, suspect, later = _held(), _held(1, STARTED), _held()
    suspect.quarantined = True
    batch.queue(running)
    batch.prepare_turn()
    batch.queue(suspect)
    batch.queue(later)
    assert batch.pull_budget(64) == 0  # nothing more is read while the suspect waits
    batch.prepare_turn()
    assert set(batch.held) == {running.job_id}  # `running` has not made progress yet
    step()
    batch.prepare_turn()
    assert set(batch.held) == {running.job_id, suspect.job_id}  # only the suspect joins
    assert batch.first_step_unsent
    batch.prepare_turn()
    assert later.job_id not in batch.held
    step()
    batch.prepare_turn()
    assert set(batch.held) == {running.job_id, suspect.job_id, later.job_id}


def _marker_writes(outbox: Outbox) -> list[tuple]:
    key = KEYS.first_step("w")
    return [c for op in outbox.ops for c in op.commands if len(c) > 1 and c[1] == key]


def test_the_first_step_marker_names_only_the_newcomers_of_one_step():
    engine = FakeEngine()
    outbox = Outbox(RedisKeys(), KEYS.jobs_stream(MODEL), "w")
    batch = Batch(
        engine,
        outbox,
        worker_name="w",
        policy=ChunkPolicy(1, 0.0),
        metrics=WorkerMetrics(MODEL),
        tracer=ChunkTracer(None),
        prompt_estimate=8,
    )
    first, second = _held(), _held()
    batch.queue(first)
    batch.prepare_turn()
    assert batch.first_step_unsent  # sent before the step
    assert ("SADD", KEYS.first_step("w"), first.job_id) in _marker_writes(outbox)
    outbox.ops.clear()
    batch.first_step_unsent = False
    batch.collect(engine.step(), None, 0.0)
    assert _marker_writes(outbox) == [("DEL", KEYS.first_step("w"))]
    outbox.ops.clear()
    batch.queue(second)
    batch.prepare_turn()
    assert [c[2:] for c in _marker_writes(outbox) if c[0] == "SADD"] == [(second.job_id,)]
    outbox.ops.clear()
    batch.collect(engine.step(), None, 0.0)
    batch.first_step_unsent = False
    batch.prepare_turn()  # no newcomer: nothing marked, nothing to send first
    assert not batch.first_step_unsent
    outbox.ops.clear()
    batch.collect(engine.step(), None, 0.0)
    assert _marker_writes(outbox) == []


async def _crash(worker: Worker, task: asyncio.Task[None]) -> None:
    """End a worker the way SIGKILL would: no hand-back, unsent writes lost, leases left."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_jobs_whose_workers_die_mid_generation_again_and_again_all_finish(redis_url):
    """Five worker deaths, more than max_attempts, none of them the jobs' fault."""
    redis = Redis.from_url(redis_url, decode_responses=True)
    deaths, max_tokens = 5, 60
    async with AsyncRedisClient(redis_url) as client:
        jobs = [
            await client.enqueue(
                model=MODEL,
                prompt_token_ids=[50 + i, 7],
                stream=i % 2 == 0,  # progress shows in chunks, or (stream=false) nowhere yet
                sampling={"max_tokens": max_tokens},
            )
            for i in range(6)
        ]
        for _ in range(deaths):
            settings = settings_for(redis_url, model=MODEL, claim_min_idle_ms=300)
            worker = Worker(settings, FakeEngine(step_seconds=0.01))
            task = asyncio.create_task(worker.run())
            await wait_for(lambda name=settings.name: _all_progressed(redis, jobs, name), 30)
            await _crash(worker, task)
        async with running_worker(
            redis_url, FakeEngine(), model=MODEL, claim_min_idle_ms=300
        ) as rescuer:
            done = [await client.wait(job.id, timeout=20) for job in jobs]
        assert rescuer.outcomes.get("dead_lettered", 0) == 0
        for job in done:
            assert job.status is JobStatus.SUCCEEDED, job.error
            assert job.attempts == deaths + 1 > POLICY.max_attempts
            assert job.crash_resumes == deaths
            want = expected_output(job.request.prompt_token_ids, max_tokens)
            if job.request.stream:
                streamed = [c for _, c in await replay_chunks(redis, job.id)]
                await check_delivery(redis, job, streamed, None, want)
            assert job.result.choices[0].token_ids == want[0]
    await redis.aclose()


async def _all_progressed(redis: Redis, jobs: list[Job], worker: str) -> bool:
    """Every job's current start is `worker`'s, and the engine produced output for it."""
    for job in jobs:
        stored = await redis.hmget(KEYS.job(job.id), ["worker", "run_state"])
        if stored != [worker, RunState.PROGRESSED.value]:
            return False
    return True


async def _orphan(
    redis: Redis,
    job: Job,
    attempts: int,
    run: RunState,
    published: int = 0,
    in_first_step: bool = False,
    worker: str = "dead",
) -> None:
    """A job as a dead `worker` left it: running, its entry pending under that worker, how far
    its start got recorded, `published` chunks in its replay stream, and (`in_first_step`) in
    that worker's first-step marker."""
    if in_first_step:
        await redis.sadd(KEYS.first_step(worker), job.id)
    stream = KEYS.jobs_stream(MODEL)
    with contextlib.suppress(Exception):
        await redis.xgroup_create(stream, KEYS.group, id="0", mkstream=True)
    entry_id = await redis.xadd(stream, {"job": job.id})
    stored = job.model_copy(
        update={
            "status": JobStatus.RUNNING,
            "attempts": attempts,
            "run_state": run,
            "worker": worker,
            "entry_id": entry_id,
            "started_at": utc_now(),
        }
    )
    await redis.hset(KEYS.job(job.id), mapping=stored.to_redis_hash())
    await redis.xreadgroup(KEYS.group, worker, {stream: ">"}, count=1)
    ids, _ = expected_output(job.request.prompt_token_ids, published)
    for index, token in enumerate(ids):
        chunk = TokenChunk(job_id=job.id, index=index, token_ids=[token], text=f" t{token}")
        await redis.xadd(
            KEYS.out_stream(job.id), {REPLAY_FIELD: chunk.to_json()}, id=chunk_stream_id(index)
        )


async def test_a_dead_workers_jobs_are_charged_only_when_it_died_in_their_first_step(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)

    def new() -> Job:
        return Job.new(
            JobRequest(model=MODEL, prompt_token_ids=[33, 34], sampling={"max_tokens": 8})
        )

    progressed, waited, stalled, doomed, crowd_a, crowd_b = (new() for _ in range(6))
    await _orphan(redis, progressed, attempts=3, run=PROGRESSED, published=5)
    await _orphan(redis, waited, attempts=2, run=STARTED, published=3)
    # each the only newcomer of the step its worker died in
    await _orphan(redis, stalled, 2, STARTED, 3, in_first_step=True, worker="dead-a")
    await _orphan(redis, doomed, 3, STARTED, 3, in_first_step=True, worker="dead-b")
    # two newcomers of one fatal step: suspects, neither charged
    await _orphan(redis, crowd_a, 3, STARTED, 2, in_first_step=True, worker="dead-c")
    await _orphan(redis, crowd_b, 3, STARTED, 2, in_first_step=True, worker="dead-c")
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, FakeEngine(), model=MODEL, claim_min_idle_ms=50),
    ):
        ok = [
            await client.wait(job.id, timeout=20)
            for job in (progressed, waited, stalled, crowd_a, crowd_b)
        ]
        failed = await client.wait(doomed.id, timeout=20)
    assert [job.status for job in ok] == [JobStatus.SUCCEEDED] * 5
    assert (ok[0].attempts, ok[0].crash_resumes) == (4, 1)  # forgiven: it had progressed
    assert (ok[1].attempts, ok[1].crash_resumes) == (3, 1)  # forgiven: not in the fatal step
    assert (ok[2].attempts, ok[2].crash_resumes) == (3, 0)  # charged twice, ran in quarantine
    assert [(j.attempts, j.crash_resumes) for j in ok[3:]] == [(4, 1)] * 2  # suspects, forgiven
    assert failed.status is JobStatus.FAILED
    assert failed.error.code is ErrorCode.MAX_ATTEMPTS_EXCEEDED
    [(_, letter)] = await redis.xrange(KEYS.dead_letters(MODEL), "-", "+")
    assert letter["job"] == doomed.id and letter["reason"] == "max_attempts_exceeded"
    await redis.aclose()


async def test_a_job_that_kills_every_worker_running_it_is_dead_lettered_and_others_finish(
    redis_url,
):
    """Real worker processes; the poison job SIGKILLs whichever worker runs it. The jobs that
    died with it the first time finish; it is dead-lettered after `max_attempts` deaths it
    alone explains (its first death, in a first step shared with the others, is not charged)."""
    redis = Redis.from_url(redis_url, decode_responses=True)
    kill = {"INFERQ_FAKE_KILL_ON_TOKEN": str(POISON_TOKEN)}
    async with AsyncRedisClient(redis_url) as client:
        innocent = [
            await client.enqueue(
                model=MODEL, prompt_token_ids=[60 + i, 8], sampling={"max_tokens": 20}
            )
            for i in range(5)
        ]
        poison = await client.enqueue(model=MODEL, prompt_token_ids=[POISON_TOKEN, 8])
        deaths, worker = 0, None
        try:
            while (await client.get(poison.id)).status not in TERMINAL_STATUSES:
                if worker is None or worker.poll() is not None:
                    if worker is not None:
                        assert worker.returncode == -signal.SIGKILL
                        deaths += 1
                        assert deaths <= POLICY.max_attempts + 1, "the poison was never charged"
                    worker = start_slow_fake_worker(
                        redis_url, MODEL, f"w{deaths}", env=kill, claim_min_idle_ms=300
                    )
                await asyncio.sleep(0.05)
            done = [await client.wait(job.id, timeout=30) for job in innocent]
            failed = await client.get(poison.id)
        finally:
            if worker is not None and worker.poll() is None:
                worker.kill()
                worker.wait()
    assert POLICY.max_attempts <= deaths <= POLICY.max_attempts + 1
    assert failed.status is JobStatus.FAILED
    assert failed.error.code is ErrorCode.MAX_ATTEMPTS_EXCEEDED
    assert all(job.status is JobStatus.SUCCEEDED for job in done)
    letters = await redis.xrange(KEYS.dead_letters(MODEL), "-", "+")
    assert [fields["job"] for _, fields in letters] == [poison.id]
    assert json.loads(await redis.hget(KEYS.job(poison.id), "error"))["code"] == (
        "max_attempts_exceeded"
    )
    await redis.aclose()
