"""The worker on the real engine and the default model, against a real redis-server: its
results equal offline `LLM.generate` greedy output, chunk for chunk."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from worker_harness import KEYS, replay_chunks, running_worker, wait_for

from engine import SamplingParams
from producer_api.client.redis_client import AsyncRedisClient
from schemas import ErrorCode, JobStatus, TokenChunk

pytestmark = [pytest.mark.anyio, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "small",
    "birds",
    "sing",
]


def mixed_prompts(count: int) -> list[tuple[str, int]]:
    """Prompts of 2..40 words and 3..8 new tokens, varied so batches mix lengths."""
    out = []
    for i in range(count):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(2 + (i * 11) % 39)]
        out.append((f"Story {i}: " + " ".join(words), 3 + (i * 5) % 6))
    return out


def reference(llm, prompts: list[tuple[str, int]]) -> list:
    params = [SamplingParams(temperature=0, max_tokens=k) for _, k in prompts]
    return llm.generate([p for p, _ in prompts], params, use_tqdm=False)


async def test_48_mixed_jobs_match_offline_greedy_and_replay_in_order(redis_url, smollm):
    prompts = mixed_prompts(48)
    expected = reference(smollm, prompts)
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, smollm.engine, model=MODEL),
    ):
        jobs = await asyncio.gather(
            *(
                client.enqueue(
                    model=MODEL, prompt=p, stream=True, sampling={"temperature": 0, "max_tokens": k}
                )
                for p, k in prompts
            )
        )
        # a subscriber joining a longest job late (after its first chunks went out)
        late_job = max(jobs, key=lambda j: j.request.sampling.max_tokens)
        await wait_for(lambda: _has_chunks(redis, late_job.id, 2), 120)
        late = [chunk async for chunk in client.stream(late_job.id)]
        done = [await client.wait(job.id, timeout=120) for job in jobs]
    for job, want in zip(done, expected, strict=True):
        assert job.status is JobStatus.SUCCEEDED, job.error
        got = job.result.choices[0]
        assert got.text == want.outputs[0].text
        assert got.token_ids == want.outputs[0].token_ids
        chunks = await replay_chunks(redis, job.id)
        assert [c.index for _, c in chunks] == list(range(len(chunks)))
        assert [t for _, c in chunks for t in c.token_ids] == got.token_ids
        assert "".join(c.text for _, c in chunks) == got.text
        assert chunks[-1][1].final and chunks[-1][1].finish_reason == got.finish_reason
        assert job.result.usage.prompt_tokens == len(want.prompt_token_ids)
    assert late == [c for _, c in await replay_chunks(redis, late_job.id)]


async def _has_chunks(redis: Redis, job_id: str, count: int) -> bool:
    return await redis.xlen(KEYS.out_stream(job_id)) >= count


async def test_oversize_prompt_fails_while_chat_and_text_jobs_go_on(redis_url, smollm):
    engine = smollm.engine
    conversation = [{"role": "user", "content": "Name a colour."}]
    params = SamplingParams(temperature=0, max_tokens=6)
    want_chat = smollm.chat([conversation], params, use_tqdm=False)[0].outputs[0]
    want_text = smollm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0]
    greedy = {"temperature": 0, "max_tokens": 6}
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, engine, model=MODEL),
    ):
        chat = await client.enqueue(model=MODEL, messages=conversation, sampling=greedy)
        huge = await client.enqueue(
            model=MODEL, prompt_token_ids=[1000] * (engine.max_model_len + 5)
        )
        text = await client.enqueue(model=MODEL, prompt="Hello there", sampling=greedy)
        failed = await client.wait(huge.id, timeout=60)
        assert failed.status is JobStatus.FAILED
        assert failed.error.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
        for job, want in ((chat, want_chat), (text, want_text)):
            done = await client.wait(job.id, timeout=60)
            assert done.status is JobStatus.SUCCEEDED
            assert done.result.choices[0].token_ids == want.token_ids


async def test_logprobs_name_each_token_by_its_text(redis_url, smollm):
    """Streamed chunks and the stored result carry the decoded token, not only its id."""
    greedy = {"temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 2}
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, smollm.engine, model=MODEL),
    ):
        job = await client.enqueue(
            model=MODEL, prompt="The capital of France is", stream=True, sampling=greedy
        )
        done = await client.wait(job.id, timeout=60)
    assert done.status is JobStatus.SUCCEEDED, done.error
    choice = done.result.choices[0]
    streamed = [lp for _, c in await replay_chunks(redis, job.id) for lp in c.logprobs or []]
    assert streamed == choice.logprobs
    assert "".join(lp.token or "" for lp in choice.logprobs) == choice.text
    decode = smollm.engine.tokenizer.decode
    for lp in choice.logprobs:
        assert lp.token == decode([lp.token_id])
        assert [t.token for t in lp.top_logprobs] == [decode([t.token_id]) for t in lp.top_logprobs]


async def test_cancel_frees_the_real_engines_blocks_within_one_step(redis_url, smollm):
    engine = smollm.engine
    aborted_after: dict[str, int] = {}
    real_abort = engine.abort

    def abort(request_id: str) -> bool:
        aborted_after[request_id] = engine.stats().num_steps
        return real_abort(request_id)

    engine.abort = abort
    redis = Redis.from_url(redis_url, decode_responses=True)
    try:
        async with (
            AsyncRedisClient(redis_url) as client,
            running_worker(redis_url, engine, model=MODEL),
        ):
            job = await client.enqueue(
                model=MODEL,
                prompt="Count to one thousand:",
                stream=True,
                sampling={"temperature": 0, "max_tokens": 500, "ignore_eos": True},
            )
            await wait_for(lambda: _has_chunks(redis, job.id, 3), 60)
            steps_at_cancel = engine.stats().num_steps
            assert engine.stats().num_running == 1
            await client.cancel(job.id)
            await wait_for(lambda: job.id in aborted_after, 30)
            assert aborted_after[job.id] - steps_at_cancel <= 1
            stats = engine.stats()
            assert stats.num_running == 0 and stats.num_blocks_free == stats.num_blocks_total
            chunks: list[TokenChunk] = [c for _, c in await replay_chunks(redis, job.id)]
            assert len(chunks) < 500 and not any(c.final for c in chunks)
            assert (await client.get(job.id)).status is JobStatus.CANCELLED
    finally:
        del engine.abort
