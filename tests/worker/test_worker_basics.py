"""A worker with a fake engine against a real redis-server: results, chunks, idempotency."""

from __future__ import annotations

import logging
import threading

import pytest
from redis.asyncio import Redis
from worker_fakes import FakeEngine, expected_output
from worker_harness import KEYS, replay_chunks, running_worker, wait_for

from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobStatus, WorkerInfo, chunk_index_from_stream_id

pytestmark = pytest.mark.anyio
MODEL = "fake-model"


async def test_jobs_succeed_with_numbered_chunks_and_results(redis_url):
    engine = FakeEngine()
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, engine, model=MODEL),
    ):
        jobs = [
            await client.enqueue(
                model=MODEL,
                prompt_token_ids=[11 + i] * (3 + i),
                stream=True,
                sampling={"max_tokens": 4 + i % 3},
            )
            for i in range(6)
        ]
        done = [await client.wait(job.id, timeout=20) for job in jobs]
        redis = client.redis
        for job in done:
            assert job.status is JobStatus.SUCCEEDED, job
            prompt = job.request.prompt_token_ids
            ids, text = expected_output(prompt, job.request.sampling.max_tokens)
            choice = job.result.choices[0]
            assert (choice.token_ids, choice.text, choice.finish_reason) == (ids, text, "length")
            assert job.result.usage.prompt_tokens == len(prompt)
            assert job.result.usage.completion_tokens == len(ids)
            assert job.attempts == 1 and job.started_at is not None
            chunks = await replay_chunks(Redis.from_url(redis_url, decode_responses=True), job.id)
            assert [c.index for _, c in chunks] == list(range(len(ids)))
            assert [chunk_index_from_stream_id(e) for e, _ in chunks] == list(range(len(ids)))
            assert [t for _, c in chunks for t in c.token_ids] == ids
            assert "".join(c.text for _, c in chunks) == text
            assert [c.final for _, c in chunks] == [False] * (len(ids) - 1) + [True]
        assert await client.redis.xlen(KEYS.jobs_stream(MODEL)) == 0  # acked and deleted
        assert await redis.ttl(KEYS.job(jobs[0].id)) > 0
        assert await redis.ttl(KEYS.out_stream(jobs[0].id)) > 0


async def test_step_time_and_the_engine_wait_between_steps_are_measured(redis_url):
    # An operator compares the two: the engine's own step, and how long it then sits idle
    # while the worker's loop collects, publishes and reads before the next step.
    engine = FakeEngine(step_seconds=0.02)
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, engine, model=MODEL) as worker,
    ):
        job = await client.enqueue(
            model=MODEL, prompt_token_ids=[11] * 3, stream=True, sampling={"max_tokens": 8}
        )
        assert (await client.wait(job.id, timeout=20)).status is JobStatus.SUCCEEDED

        def value(name: str) -> float:
            sample = worker.metrics.registry.get_sample_value(name, {"model": MODEL})
            assert sample is not None, name
            return sample

        steps = value("inferq_worker_step_seconds_count")
        assert steps == engine.steps >= 8
        assert value("inferq_worker_step_seconds_sum") >= 0.02 * steps  # the step's own time
        # one wait before every step of the running batch but its first
        assert value("inferq_worker_engine_wait_seconds_count") == steps - 1
        assert value("inferq_worker_engine_wait_seconds_sum") >= 0


async def test_heartbeat_reports_capacity(redis_url):
    engine = FakeEngine(num_kv_blocks=77)
    async with running_worker(redis_url, engine, model=MODEL, name="hb-worker") as worker:
        redis = Redis.from_url(redis_url, decode_responses=True)

        async def beat():
            return await redis.hgetall(KEYS.worker("hb-worker"))

        await wait_for(beat)
        fields = await beat()
        assert fields.pop("max_model_len") == str(engine.max_model_len)
        info = WorkerInfo.from_redis_hash(fields)
        assert (info.model, info.kv_blocks_total, info.kv_blocks_free) == (MODEL, 77, 77)
        assert info.vocab_size == engine.vocab_size  # the API refuses unknown ids with it
        assert 0 < await redis.ttl(KEYS.worker("hb-worker")) <= worker.settings.heartbeat_ttl_s
        assert (info.quantization, info.weight_bytes) == (None, 0)  # full precision
    assert not await redis.exists(KEYS.worker("hb-worker"))  # a stopped worker says goodbye


async def test_heartbeat_and_start_log_name_the_quantization_and_weight_bytes(redis_url, caplog):
    caplog.set_level(logging.INFO, logger="worker.worker")
    engine = FakeEngine(
        quantization="int4", weight_bytes=95 * 2**20, architecture="GptOssForCausalLM"
    )
    async with running_worker(redis_url, engine, model=MODEL, name="hb-quantized"):
        redis = Redis.from_url(redis_url, decode_responses=True)

        async def beat():
            return await redis.hgetall(KEYS.worker("hb-quantized"))

        await wait_for(beat)
        info = WorkerInfo.from_redis_hash(await beat())
        assert (info.quantization, info.weight_bytes) == ("int4", 95 * 2**20)
        assert info.architecture == "GptOssForCausalLM"
    started = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("worker_started")
    ]
    assert len(started) == 1
    assert "quantization=int4" in started[0] and "weight_mib=95.0" in started[0]


async def _finished_chunks(client: AsyncRedisClient, redis_url: str, **request) -> tuple:
    job = await client.enqueue(model=MODEL, **request)
    done = await client.wait(job.id, timeout=20)
    assert done.status is JobStatus.SUCCEEDED, done
    chunks = [c for _, c in await replay_chunks(Redis.from_url(redis_url), job.id)]
    return done, chunks


async def test_coalescing_choices_and_unstreamed_jobs(redis_url):
    engine = FakeEngine()
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, engine, model=MODEL, chunk_tokens=4, chunk_interval_ms=10_000),
    ):
        prompt = [33, 34, 35]
        # every 4 tokens, across 2 choices numbered together; the last chunk is final
        done, chunks = await _finished_chunks(
            client,
            redis_url,
            prompt_token_ids=prompt,
            stream=True,
            sampling={"max_tokens": 10, "n": 2},
        )
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert chunks[-1].final and sum(c.final for c in chunks) == 1
        for choice in (0, 1):
            ids, text = expected_output(prompt, 10, choice)
            mine = [c for c in chunks if c.choice == choice]
            assert [len(c.token_ids) for c in mine] == [4, 4, 2]
            assert "".join(c.text for c in mine) == text == done.result.choices[choice].text
            assert [t for c in mine for t in c.token_ids] == ids
            assert mine[-1].finish_reason == "length"
        assert done.result.usage.completion_tokens == 20
        # stream=false: one chunk per choice at the end
        done, chunks = await _finished_chunks(
            client,
            redis_url,
            prompt_token_ids=prompt,
            stream=False,
            sampling={"max_tokens": 7, "n": 2},
        )
        assert [(c.index, c.choice, len(c.token_ids), c.final) for c in chunks] == [
            (0, 0, 7, False),
            (1, 1, 7, True),
        ]


async def test_a_job_finished_elsewhere_is_acked_without_running(redis_url):
    engine = FakeEngine()
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client:
        job = await client.enqueue(model=MODEL, prompt="done already")
        await redis.hset(KEYS.job(job.id), "status", "succeeded")
        async with running_worker(redis_url, engine, model=MODEL) as worker:

            async def backlog_empty() -> bool:
                return await redis.xlen(KEYS.jobs_stream(MODEL)) == 0

            await wait_for(backlog_empty, 10)
            assert engine.steps == 0 and not worker.outcomes


class ThreadRecordingEngine(FakeEngine):
    """Notes the thread of its construction and of every step."""

    def __init__(self) -> None:
        super().__init__()
        self.built_on = threading.get_ident()
        self.stepped_on: set[int] = set()

    def step(self):
        self.stepped_on.add(threading.get_ident())
        return super().step()


def build_thread_recording_engine(settings) -> ThreadRecordingEngine:
    return ThreadRecordingEngine()


async def test_engine_is_built_and_stepped_on_one_thread_off_the_event_loop(redis_url):
    # torch gives each calling thread its own OpenMP team; a second team makes libgomp stop
    # spin-waiting and slows every step (see Worker.__init__), so loading and steps share one.
    factory = f"{__name__}:build_thread_recording_engine"
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, None, model=MODEL, engine_factory=factory) as worker,
    ):
        jobs = [
            await client.enqueue(model=MODEL, prompt_token_ids=[5, 6], sampling={"max_tokens": 3})
            for _ in range(3)
        ]
        for job in jobs:
            assert (await client.wait(job.id, timeout=20)).status is JobStatus.SUCCEEDED
    engine = worker.engine
    assert engine.stepped_on == {engine.built_on}
    assert engine.built_on != threading.get_ident()
