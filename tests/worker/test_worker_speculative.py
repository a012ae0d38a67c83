"""A speculating worker over the queue (slow, the default model): chunks carry several tokens
per step, and a SIGKILL mid-generation followed by a resume on another speculating worker
still delivers every chunk number once and the tokens of an uninterrupted run without
speculation (greedy jobs, and seeded sampled ones)."""

from __future__ import annotations

import asyncio
import json

import pytest
from redis.asyncio import Redis
from worker_harness import (
    KEYS,
    LiveTap,
    check_delivery,
    running_worker,
    start_worker_process,
    stream_all,
    wait_for,
)

from engine import LLM, SamplingParams
from engine.model_files import DEFAULT_MODEL
from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobStatus

pytestmark = [pytest.mark.anyio, pytest.mark.model, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
TEXT = "the blue boat left the harbour at dawn and came back at noon with the nets full. "


def _prompts(count: int) -> list[str]:
    return [f"Copy this text {i}: {TEXT * (1 + i % 3)}\nCopy: " for i in range(count)]


def _params(index: int, max_tokens: int) -> dict:
    if index % 2:
        return {"temperature": 0.8, "seed": index, "max_tokens": max_tokens, "ignore_eos": True}
    return {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}


@pytest.fixture(scope="module")
def speculating() -> LLM:
    return LLM(DEFAULT_MODEL, dtype="float32", speculative_config=SPEC)


async def test_speculating_worker_killed_mid_generation_resumes_exactly(
    redis_url, smollm, speculating
):
    prompts, max_tokens = _prompts(10), 48
    params = [SamplingParams(**_params(i, max_tokens)) for i in range(len(prompts))]
    outputs = smollm.generate(prompts, params, use_tqdm=False)
    expected = [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client, LiveTap(redis) as tap:
        jobs = [
            await client.enqueue(
                model=MODEL, prompt=p, stream=True, sampling=_params(i, max_tokens)
            )
            for i, p in enumerate(prompts)
        ]
        streams = [asyncio.create_task(stream_all(client, job.id)) for job in jobs]
        doomed = start_worker_process(
            redis_url, fake=False, model=MODEL, name="doomed", speculative_config=json.dumps(SPEC)
        )

        async def all_started() -> bool:
            return min([await redis.xlen(KEYS.out_stream(job.id)) for job in jobs]) >= 3

        try:
            await wait_for(all_started, 300)
        finally:
            doomed.kill()
            doomed.wait()
        async with running_worker(redis_url, speculating.engine, model=MODEL, name="rescuer"):
            streamed = await asyncio.wait_for(asyncio.gather(*streams), 300)
            done = [await client.wait(job.id, timeout=120) for job in jobs]
        for job, chunks, want in zip(done, streamed, expected, strict=True):
            assert job.status is JobStatus.SUCCEEDED and job.worker == "rescuer"
            await check_delivery(redis, job, chunks, tap.chunks.get(job.id, []), want)
        # Accepted drafts: some step published more than one token of a job at once.
        assert any(len(c.token_ids) > 1 for chunks in streamed for c in chunks)
    assert speculating.engine.stats().spec_num_accepted_tokens > 0
    await redis.aclose()
