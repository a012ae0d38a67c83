"""A tensor-parallel worker (2 CPU ranks) over the queue, on the default model (slow): it serves
jobs as the offline engine does, and a rank that dies takes the replica down within seconds, so
another worker finishes every job with no chunk delivered twice."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from real_model_jobs import (
    MODEL,
    enqueue,
    greedy_params,
    note_prompts,
    reference,
)
from redis.asyncio import Redis
from worker_harness import (
    KEYS,
    LiveTap,
    all_have_chunks,
    check_delivery,
    running_worker,
    start_worker_process,
    stop_process,
    stream_all,
    wait_for,
)

from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobStatus

pytestmark = [pytest.mark.anyio, pytest.mark.model, pytest.mark.slow]
TP = {"tensor_parallel_size": 2, "num_threads": 1}


def _executor_ranks(worker_pid: int) -> list[int]:
    """pids of the executor ranks a worker started (its children running the executor)."""
    # Each thread lists the children it started (the engine thread starts the ranks).
    threads = Path(f"/proc/{worker_pid}/task").glob("*/children")
    children = [pid for thread in threads for pid in thread.read_text().split()]
    ranks = []
    for pid in map(int, children):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"engine.distributed.executor" in command:
            ranks.append(pid)
    return ranks


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return status != "Z"


async def test_tp2_worker_serves_like_the_offline_engine_and_stops_every_rank(redis_url, smollm):
    prompts, max_tokens = note_prompts(6), 24
    expected = reference(smollm, prompts, max_tokens)
    redis = Redis.from_url(redis_url, decode_responses=True)
    worker = start_worker_process(redis_url, fake=False, model=MODEL, name="tp2", **TP)
    try:
        async with AsyncRedisClient(redis_url) as client, LiveTap(redis) as tap:
            jobs = await enqueue(client, prompts, max_tokens)
            cancelled = await client.enqueue(
                model=MODEL,
                prompt="Count slowly to one thousand:",
                stream=True,
                sampling=greedy_params(2000),
            )
            streams = [asyncio.create_task(stream_all(client, job.id)) for job in jobs]
            streamed = await asyncio.wait_for(asyncio.gather(*streams), 600)
            done = [await client.wait(job.id, timeout=120) for job in jobs]
            await wait_for(lambda: redis.xlen(KEYS.out_stream(cancelled.id)), 120)
            await client.cancel(cancelled.id)
            final = await client.wait(cancelled.id, timeout=60)
            assert final.status is JobStatus.CANCELLED
            for job, chunks, want in zip(done, streamed, expected, strict=True):
                assert job.status is JobStatus.SUCCEEDED and job.worker == "tp2"
                await check_delivery(redis, job, chunks, tap.chunks.get(job.id, []), want)
        ranks = _executor_ranks(worker.pid)
        assert len(ranks) == 1
    finally:
        code = await asyncio.to_thread(stop_process, worker, signal.SIGTERM, 60)
    assert code == 0, worker.log_path.read_text()[-3000:]
    assert not any(_alive(pid) for pid in ranks)


async def test_sigkill_of_the_executor_rank_takes_the_replica_down(redis_url, smollm):
    prompts, max_tokens = note_prompts(8), 40
    expected = reference(smollm, prompts, max_tokens)
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client, LiveTap(redis) as tap:
        jobs = await enqueue(client, prompts, max_tokens)
        streams = [asyncio.create_task(stream_all(client, job.id)) for job in jobs]
        doomed = start_worker_process(redis_url, fake=False, model=MODEL, name="doomed", **TP)
        try:
            await wait_for(lambda: all_have_chunks(redis, jobs, 4), 600)
            (rank,) = _executor_ranks(doomed.pid)
            os.kill(rank, signal.SIGKILL)
            killed_at = time.monotonic()
            code = await asyncio.to_thread(doomed.wait, 30)
            took = time.monotonic() - killed_at
        finally:
            if doomed.poll() is None:
                doomed.kill()
                doomed.wait()
        assert code != 0 and took < 10, (code, took)
        assert not await all_have_chunks(redis, jobs, max_tokens)
        async with running_worker(redis_url, smollm.engine, model=MODEL, name="rescuer"):
            streamed = await asyncio.wait_for(asyncio.gather(*streams), 300)
            done = [await client.wait(job.id, timeout=120) for job in jobs]
        for job, chunks, want in zip(done, streamed, expected, strict=True):
            assert job.status is JobStatus.SUCCEEDED and job.worker == "rescuer"
            await check_delivery(redis, job, chunks, tap.chunks.get(job.id, []), want)
