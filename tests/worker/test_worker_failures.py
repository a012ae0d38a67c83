"""Poison entries, engine failures, cancellation and deadlines (fake engine, real Redis)."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import pytest
from redis.asyncio import Redis
from worker_fakes import VOCAB, FakeEngine, expected_output
from worker_harness import KEYS, replay_chunks, running_worker, wait_for

from producer_api.client.redis_client import AsyncRedisClient
from schemas import ErrorCode, Job, JobRequest, JobStatus, utc_now

pytestmark = pytest.mark.anyio
MODEL = "fake-model"


async def _dead_letters(redis: Redis) -> list[dict[str, str]]:
    return [fields for _, fields in await redis.xrange(KEYS.dead_letters(MODEL), "-", "+")]


async def _store_raw_job(redis: Redis, job: Job, **overrides: str) -> None:
    """Queue a job the way enqueue does, with some hash fields replaced (a corrupt writer)."""
    entry_id = await redis.xadd(KEYS.jobs_stream(MODEL), {"job": job.id})
    fields = {**job.to_redis_hash(), "entry_id": entry_id, **overrides}
    await redis.hset(KEYS.job(job.id), mapping=fields)


async def test_poison_entries_fail_with_codes_and_the_batch_goes_on(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client:
        good = [
            await client.enqueue(
                model=MODEL, prompt_token_ids=[20 + i] * 5, sampling={"max_tokens": 6}
            )
            for i in range(3)
        ]
        await redis.xadd(KEYS.jobs_stream(MODEL), {"garbage": "yes"})
        bad_params = Job.new(JobRequest(model=MODEL, prompt="hi"))
        request = json.loads(bad_params.request.to_json())
        request["sampling"]["temperature"] = 7.5
        await _store_raw_job(redis, bad_params, request=json.dumps(request))
        oversize = await client.enqueue(model=MODEL, prompt_token_ids=[30] * 600)  # context 512
        too_often = Job.new(JobRequest(model=MODEL, prompt="again"))
        await _store_raw_job(redis, too_often, attempts="3")
        good += [
            await client.enqueue(
                model=MODEL, prompt_token_ids=[40 + i] * 7, sampling={"max_tokens": 6}
            )
            for i in range(3)
        ]
        async with running_worker(redis_url, FakeEngine(), model=MODEL) as worker:
            finished = [await client.wait(job.id, timeout=20) for job in good]
            assert all(job.status is JobStatus.SUCCEEDED for job in finished)
            for job in finished:
                _, text = expected_output(job.request.prompt_token_ids, 6)
                assert job.result.choices[0].text == text
            expected_codes = {
                bad_params.id: ErrorCode.INVALID_REQUEST,
                oversize.id: ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                too_often.id: ErrorCode.MAX_ATTEMPTS_EXCEEDED,
            }
            for job_id, code in expected_codes.items():
                await wait_for(lambda job_id=job_id: _status_is(redis, job_id, "failed"), 10)
                error = json.loads(await redis.hget(KEYS.job(job_id), "error"))
                assert error["code"] == code.value, error
            await wait_for(lambda: _backlog_is(redis, 0), 10)
            letters = await _dead_letters(redis)
            reasons = {letter["job"]: letter["reason"] for letter in letters}
            # the too-long prompt is the client's mistake: a failed job, not a dead letter
            assert reasons == {
                "": "unparseable_job",
                **{k: v.value for k, v in expected_codes.items() if k != oversize.id},
            }
            garbage = next(letter for letter in letters if letter["job"] == "")
            assert json.loads(garbage["entry"]) == {"garbage": "yes"}
            assert worker.outcomes["succeeded"] == len(good)


async def test_client_mistakes_found_at_admission_fail_with_a_code_and_no_dead_letter(redis_url):
    """What only the engine can find (too long once templated, an id outside the vocabulary,
    for jobs that skipped the API's checks) fails the job with a code: dead letters are for
    entries the system could not handle, so an operator can alert on them."""
    redis = Redis.from_url(redis_url, decode_responses=True)
    engine = FakeEngine(max_model_len=64)
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, engine, model=MODEL) as worker,
    ):
        out_of_vocab = await client.enqueue(
            model=MODEL, prompt_token_ids=[12, VOCAB + 3], stream=True
        )
        # 60 characters fit the context as text, not once the chat template wraps them
        too_long = await client.enqueue(
            model=MODEL, messages=[{"role": "user", "content": "x" * 60}]
        )
        good = await client.enqueue(
            model=MODEL, prompt_token_ids=[12, 13], sampling={"max_tokens": 3}
        )
        for job, code in (
            (out_of_vocab, "invalid_token_id"),
            (too_long, "context_length_exceeded"),
        ):
            failed = await client.wait(job.id, timeout=10)
            assert failed.status is JobStatus.FAILED
            assert failed.error.code == code, failed.error
        assert (await client.wait(good.id, timeout=10)).status is JobStatus.SUCCEEDED
        await wait_for(lambda: _backlog_is(redis, 0), 10)
        assert await _dead_letters(redis) == []
        assert worker.outcomes.get("failed") == 2
        assert "dead_lettered" not in worker.outcomes


async def test_a_failing_engine_step_fails_its_batch_only(redis_url):
    engine = FakeEngine(fail_on_prompt_token=999)
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, engine, model=MODEL),
    ):
        doomed = await client.enqueue(model=MODEL, prompt_token_ids=[999, 12], stream=True)
        failed = await client.wait(doomed.id, timeout=10)
        assert failed.status is JobStatus.FAILED and failed.error.code is ErrorCode.ENGINE_ERROR
        later = await client.enqueue(
            model=MODEL, prompt_token_ids=[12, 13], sampling={"max_tokens": 3}
        )
        assert (await client.wait(later.id, timeout=10)).status is JobStatus.SUCCEEDED


class _CountingEngine(FakeEngine):
    """Remembers which step each abort happened after, and every request it was given."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.aborted_at_step: dict[str, int] = {}
        self.added: list[str] = []

    def add_request(self, new):
        self.added.append(new.request_id)
        return super().add_request(new)

    def abort(self, request_id: str) -> bool:
        self.aborted_at_step[request_id] = self.steps
        return super().abort(request_id)


async def test_cancel_mid_generation_frees_blocks_within_one_step(redis_url):
    engine = _CountingEngine(step_seconds=0.05)
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, engine, model=MODEL),
    ):
        job = await client.enqueue(
            model=MODEL, prompt_token_ids=[15] * 40, stream=True, sampling={"max_tokens": 400}
        )
        await wait_for(lambda: _has_chunks(redis, job.id, 3))
        steps_at_cancel = engine.steps
        assert engine.stats().num_blocks_free < engine.num_kv_blocks
        cancelled = await client.cancel(job.id)
        assert cancelled.status is JobStatus.CANCELLED
        assert await redis.xlen(KEYS.jobs_stream(MODEL)) == 0  # off the backlog at once
        await wait_for(lambda: job.id in engine.aborted_at_step, 5)
        assert engine.aborted_at_step[job.id] - steps_at_cancel <= 1
        assert engine.stats().num_blocks_free == engine.num_kv_blocks
        await wait_for(lambda: redis.xpending(KEYS.jobs_stream(MODEL), "workers"), 5)
        pending = await redis.xpending(KEYS.jobs_stream(MODEL), "workers")
        assert pending["pending"] == 0
        final = await client.get(job.id)
        assert final.status is JobStatus.CANCELLED and final.error.code is ErrorCode.CANCELLED


async def _backlog_is(redis: Redis, length: int) -> bool:
    return await redis.xlen(KEYS.jobs_stream(MODEL)) == length


async def _status_is(redis: Redis, job_id: str, status: str) -> bool:
    return await redis.hget(KEYS.job(job_id), "status") == status


async def _has_chunks(redis: Redis, job_id: str, count: int) -> bool:
    return await redis.xlen(KEYS.out_stream(job_id)) >= count


async def test_expired_job_never_runs_and_deadline_aborts_a_running_one(redis_url):
    engine = _CountingEngine(step_seconds=0.02)
    async with AsyncRedisClient(redis_url) as client:
        stale = await client.enqueue(model=MODEL, prompt="too late", timeout_s=0.2)
        await asyncio.sleep(0.4)
        async with running_worker(redis_url, engine, model=MODEL):
            expired = await client.wait(stale.id, timeout=10)
            assert expired.status is JobStatus.EXPIRED and expired.error.code is ErrorCode.EXPIRED
            assert stale.id not in engine.added
            deadline = utc_now() + timedelta(seconds=0.6)
            long = await client.enqueue(
                model=MODEL,
                prompt_token_ids=[16] * 8,
                stream=True,
                deadline=deadline,
                sampling={"max_tokens": 500},
            )
            over = await client.wait(long.id, timeout=10)
            assert over.status is JobStatus.EXPIRED
            assert over.error.code is ErrorCode.DEADLINE_EXCEEDED
            assert long.id in engine.aborted_at_step
            assert 0 < len(await replay_chunks(client.redis, long.id)) < 500
            assert engine.stats().num_blocks_free == engine.num_kv_blocks
