"""A failing engine step fails only the job that reproduces the failure; the others go on from
their output so far, each chunk once. Running out of device memory shrinks the batch and fails
no one (the search in worker.step_failures; fake engine and the default model, real Redis)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from redis.asyncio import Redis
from worker_fakes import FakeEngine, expected_output
from worker_harness import check_delivery, running_worker, stream_all

from producer_api.client.redis_client import AsyncRedisClient
from schemas import ErrorCode, Job, JobStatus
from worker.step_failures import Bisect

pytestmark = pytest.mark.anyio
MODEL = "fake-model"
POISON_TOKEN = 999


def test_a_search_narrows_to_the_probe_that_fails_and_names_a_job_only_when_it_fails_alone():
    bisect = Bisect("boom", [f"j{i}" for i in range(6)])
    alive = set(bisect.suspects)
    assert bisect.next_probe(alive, None) == ["j0", "j1", "j2"]
    assert bisect.next_probe(alive, None) == ["j0", "j1", "j2"]  # kept until its step reports
    assert not bisect.probe_passed()
    assert bisect.next_probe(alive, None) == ["j3"]
    assert bisect.probe_failed() == "j3"


def test_a_search_that_reproduces_nothing_clears_everyone():
    bisect = Bisect("boom", ["a", "b", "c"])
    alive = {"a", "b"}  # c ended meanwhile
    assert bisect.next_probe(alive, None) == ["a"]
    assert not bisect.probe_passed()
    assert bisect.next_probe(alive, None) == ["b"]
    assert bisect.probe_passed()
    assert bisect.steps == 2


def test_a_probe_group_keeps_under_the_engine_cap():
    bisect = Bisect("boom", [f"j{i}" for i in range(16)])
    assert bisect.next_probe(set(bisect.suspects), 3) == ["j0", "j1", "j2"]
    assert bisect.probe_failed() is None
    assert bisect.suspects == ["j0", "j1", "j2"]


async def _enqueue(
    client: AsyncRedisClient, prompts: list[list[int]], max_tokens: int
) -> list[Job]:
    return [
        await client.enqueue(
            model=MODEL, prompt_token_ids=p, stream=True, sampling={"max_tokens": max_tokens}
        )
        for p in prompts
    ]


async def test_one_job_that_makes_the_engine_raise_fails_alone_among_16(redis_url):
    """The poison raises once it has 5 tokens, mid-generation for all 16: exactly it fails with
    engine_error; the 15 others end with their uninterrupted output, each chunk once."""
    redis = Redis.from_url(redis_url, decode_responses=True)
    max_tokens = 30
    engine = FakeEngine(fail_on_prompt_token=POISON_TOKEN, fail_after_tokens=5, step_seconds=0.01)
    prompts = [[40 + i, 7, 8] for i in range(15)]
    async with AsyncRedisClient(redis_url) as client:
        jobs = await _enqueue(client, prompts, max_tokens)
        poison = await client.enqueue(
            model=MODEL,
            prompt_token_ids=[POISON_TOKEN, 7],
            stream=True,
            sampling={"max_tokens": max_tokens},
        )
        streams = {j.id: asyncio.create_task(stream_all(client, j.id)) for j in [*jobs, poison]}
        async with running_worker(redis_url, engine, model=MODEL) as worker:
            done = [await client.wait(job.id, timeout=30) for job in jobs]
            failed = await client.wait(poison.id, timeout=30)
        assert failed.status is JobStatus.FAILED
        assert failed.error.code is ErrorCode.ENGINE_ERROR
        poisoned = await asyncio.wait_for(streams[poison.id], 10)
        assert [c.index for c in poisoned] == list(range(len(poisoned)))
        assert poisoned[-1].final and poisoned[-1].finish_reason == "error"
        assert worker.outcomes == {"succeeded": 15, "failed": 1}
        for job in done:
            assert job.status is JobStatus.SUCCEEDED, job.error
            want = expected_output(job.request.prompt_token_ids, max_tokens)
            streamed = await asyncio.wait_for(streams[job.id], 10)
            await check_delivery(redis, job, streamed, None, want)
    await redis.aclose()


class _SmallMemoryEngine(FakeEngine):
    """Runs out of device memory whenever a step would run more than `fits` sequences."""

    def __init__(self, fits: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fits = fits
        self.out_of_memory = 0
        self.largest_step = 0

    def step(self):
        running = len(self._running) + len(self._waiting)
        if running > self.fits:
            self.out_of_memory += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.largest_step = max(self.largest_step, running)
        return super().step()


async def test_running_out_of_memory_shrinks_the_batch_and_fails_no_one(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    max_tokens = 12
    engine = _SmallMemoryEngine(fits=3, step_seconds=0.005)
    prompts = [[60 + i, 9] for i in range(8)]
    async with AsyncRedisClient(redis_url) as client:
        jobs = await _enqueue(client, prompts, max_tokens)
        streams = {job.id: asyncio.create_task(stream_all(client, job.id)) for job in jobs}
        async with running_worker(redis_url, engine, model=MODEL) as worker:
            done = [await client.wait(job.id, timeout=30) for job in jobs]
        assert engine.out_of_memory >= 1
        assert 1 <= engine.largest_step <= 3
        assert worker.outcomes == {"succeeded": 8}
        for job in done:
            want = expected_output(job.request.prompt_token_ids, max_tokens)
            streamed = await asyncio.wait_for(streams[job.id], 10)
            await check_delivery(redis, job, streamed, None, want)
    await redis.aclose()


async def test_a_job_that_runs_out_of_memory_alone_fails_and_the_worker_serves_on(redis_url):
    engine = _SmallMemoryEngine(fits=0)
    async with AsyncRedisClient(redis_url) as client:
        async with running_worker(redis_url, engine, model=MODEL) as worker:
            job = await client.enqueue(model=MODEL, prompt_token_ids=[5, 6])
            failed = await client.wait(job.id, timeout=10)
            engine.fits = 1
            later = await client.enqueue(model=MODEL, prompt_token_ids=[5, 7])
            assert (await client.wait(later.id, timeout=10)).status is JobStatus.SUCCEEDED
        assert failed.status is JobStatus.FAILED
        assert failed.error.code is ErrorCode.ENGINE_ERROR
        assert "out of memory" in failed.error.message
        assert worker.outcomes == {"failed": 1, "succeeded": 1}


@pytest.mark.slow
@pytest.mark.model
async def test_one_request_that_makes_the_real_engine_raise_fails_alone_among_16(
    redis_url, smollm, monkeypatch
):
    """The default model; the model runner raises inside the step once the poison request has
    4 tokens (the scheduler has already planned that step). The 15 others end with the greedy
    text of a run without the poison, each chunk once."""
    from real_model_jobs import MODEL as REAL_MODEL
    from real_model_jobs import greedy_params, note_prompts, reference

    max_tokens = 24
    prompts = note_prompts(15)
    expected = reference(smollm, prompts, max_tokens)
    runner = smollm.engine.runner
    execute = runner.execute
    poison_id: list[str] = []

    def failing_execute(sched, batch):
        for scheduled in sched.scheduled:
            seq = scheduled.seq
            if seq.request_id in poison_id and seq.num_output_tokens >= 4:
                raise RuntimeError("device-side assert triggered")
        return execute(sched, batch)

    monkeypatch.setattr(runner, "execute", failing_execute)
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client:
        poison = await client.enqueue(
            model=REAL_MODEL,
            prompt="A poisoned request",
            stream=True,
            sampling=greedy_params(max_tokens),
        )
        poison_id.append(poison.id)
        jobs = [
            await client.enqueue(
                model=REAL_MODEL, prompt=p, stream=True, sampling=greedy_params(max_tokens)
            )
            for p in prompts
        ]
        streams = {j.id: asyncio.create_task(stream_all(client, j.id)) for j in [*jobs, poison]}
        async with running_worker(redis_url, smollm.engine, model=REAL_MODEL) as worker:
            done = [await client.wait(job.id, timeout=300) for job in jobs]
            failed = await client.wait(poison.id, timeout=60)
        assert failed.status is JobStatus.FAILED
        assert failed.error.code is ErrorCode.ENGINE_ERROR
        poisoned = await asyncio.wait_for(streams[poison.id], 10)
        assert [c.index for c in poisoned] == list(range(len(poisoned)))
        assert poisoned[-1].finish_reason == "error"
        assert worker.outcomes == {"succeeded": 15, "failed": 1}
        for job, want in zip(done, expected, strict=True):
            assert job.status is JobStatus.SUCCEEDED, job.error
            streamed = await asyncio.wait_for(streams[job.id], 10)
            await check_delivery(redis, job, streamed, None, want)
    await redis.aclose()
