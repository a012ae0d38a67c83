"""Chunks a master acknowledged but never replicated: after a failover the new master's replay
streams end early, and the worker re-publishes what they lack before anything else, so every
stream still holds chunks 0..n once each and a resuming client sees each number once."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from worker_fakes import FakeEngine, expected_output
from worker_harness import (
    KEYS,
    all_have_chunks,
    check_delivery,
    replay_chunks,
    running_worker,
    wait_for,
)

from bench.availability.sentinel_cluster import MASTER_NAME, SentinelCluster, ask, redis_binary
from producer_api.client import AsyncClient
from redis_io.clients import master_address, redis_client
from schemas import Job, JobStatus, TokenChunk
from schemas.chunks import REPLAY_FIELD
from schemas.redis_connection import ReplicaWait
from worker.publisher import Outbox
from worker.replay_log import refill
from worker.settings import WorkerSettings

pytestmark = pytest.mark.anyio
MODEL = "fake-model"
JOB = "job_AAAAAAAAAAAAAAAAAAAAAA"


def _chunk(index: int, final: bool = False) -> TokenChunk:
    return TokenChunk(
        job_id=JOB,
        index=index,
        text=f" t{index}",
        token_ids=[index],
        finish_reason="length" if final else None,
        final=final,
    )


async def _indices(redis: Redis, job_id: str) -> list[int]:
    return [chunk.index for _, chunk in await replay_chunks(redis, job_id)]


async def test_refill_puts_back_the_lost_tail_before_newer_chunks_go_out(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    outbox = Outbox(KEYS, KEYS.jobs_stream(MODEL), "w")
    for index in range(6):
        outbox.chunk(_chunk(index))
    await outbox.flush(redis)
    # the promoted replica had chunks 0..2 only
    kept = await redis.xrange(KEYS.out_stream(JOB), "-", "0-3")
    await redis.delete(KEYS.out_stream(JOB))
    for entry_id, fields in kept:
        await redis.xadd(KEYS.out_stream(JOB), fields, id=entry_id)
    outbox.chunk(_chunk(6))
    outbox.chunk(_chunk(7, final=True))
    assert len(outbox.replay) == 6  # only what Redis acknowledged is kept
    sent = await refill(redis, outbox.replay, 1000, 60, REPLAY_FIELD)
    await outbox.flush(redis)
    assert sent == 3
    assert await _indices(redis, JOB) == list(range(8))
    outbox.replay.keep_only([])  # the job left this worker: nothing kept for it
    assert len(outbox.replay) == 0
    assert await refill(redis, outbox.replay, 1000, 60, REPLAY_FIELD) == 0
    await redis.aclose()


async def test_a_result_is_acked_after_the_replica_wait_even_when_it_times_out(redis_url, caplog):
    redis = Redis.from_url(redis_url, decode_responses=True)
    stream = KEYS.jobs_stream(MODEL)
    await redis.xgroup_create(stream, KEYS.group, id="0", mkstream=True)
    await redis.xadd(stream, {"job": JOB})
    entry_id = (await redis.xreadgroup(KEYS.group, "w", {stream: ">"}))[0][1][0][0]
    outbox = Outbox(KEYS, stream, "w", replicas=ReplicaWait(1, 50))
    outbox.ack(entry_id)
    await outbox.flush(redis)
    assert "results_not_replicated" in caplog.text  # no replica here: logged, not stuck
    assert (await redis.xpending(stream, KEYS.group))["pending"] == 0
    await redis.aclose()


@pytest.fixture
def pair(tmp_path: Path):
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not found")
    cluster = SentinelCluster(tmp_path / "redis", binary, sentinel_count=1)
    cluster.start(sentinels=False)
    promoted: list[subprocess.Popen[bytes]] = []
    yield cluster, binary, promoted
    cluster.stop()
    for process in promoted:
        process.kill()
        process.wait()


async def test_a_worker_refills_the_streams_a_failover_cut_short(pair):
    cluster, binary, promoted = pair
    url = f"redis://127.0.0.1:{cluster.master_port}/0"
    engine = FakeEngine(step_seconds=0.03)
    redis = Redis.from_url(url, decode_responses=True)
    async with AsyncClient(url, max_retries=100) as client:
        jobs: list[Job] = [
            await client.enqueue(
                model=MODEL,
                prompt_token_ids=[70 + i, 71, 72],
                stream=True,
                sampling={"max_tokens": 60},
            )
            for i in range(8)
        ]
        streams = [asyncio.create_task(_collect(client, job.id)) for job in jobs]
        # The replica must hold the jobs before it stops following: a promoted copy that never
        # saw an acknowledged job is what the replica wait guards against, not this test.
        replica = Redis(port=cluster.replica_port, decode_responses=True)
        await wait_for(lambda: _has_jobs(replica, jobs), 30)
        await replica.aclose()
        async with running_worker(url, engine, model=MODEL) as worker:
            await wait_for(lambda: all_have_chunks(redis, jobs, 3), 30)
            # the replica stops following here: what the master takes from now on is lost
            ask(cluster.replica_port, "REPLICAOF", "NO", "ONE")
            await wait_for(lambda: all_have_chunks(redis, jobs, 8), 30)
            cluster.kill_master()
            # A failover is noticed by a failed call (or a new master address): let the worker
            # fail one before the promoted copy answers on the old address.
            await wait_for(lambda: _redis_failed(worker), 30)
            assert "+OK" in ask(cluster.replica_port, "SAVE", timeout=10)
            # the promoted copy answers where the master did (as a Sentinel client would find it)
            promoted.append(
                subprocess.Popen(
                    [binary, "--port", str(cluster.master_port), "--bind", "127.0.0.1",
                     "--dir", str(cluster.root), "--save", "", "--appendonly", "no"],
                    stdout=subprocess.DEVNULL,
                )
            )  # fmt: skip
            done = [await _wait_through_the_switch(client, job.id) for job in jobs]
            assert worker.outcomes.get("succeeded") == len(jobs), worker.outcomes
            assert worker.metrics.chunks_republished.labels(MODEL)._value.get() > 0
        results = await asyncio.wait_for(asyncio.gather(*streams), 60)
    redis = Redis.from_url(url, decode_responses=True)
    for job, streamed in zip(done, results, strict=True):
        assert job.status is JobStatus.SUCCEEDED
        expected = expected_output(job.request.prompt_token_ids, job.request.sampling.max_tokens)
        await check_delivery(redis, job, streamed, None, expected)
    await redis.aclose()


async def test_the_worker_client_knows_which_master_it_reached(pair):
    cluster, _, _ = pair
    cluster.start_sentinels(wait_for_peers=False)
    where = WorkerSettings(
        redis_sentinels=cluster.sentinels, redis_master_name=MASTER_NAME, model=MODEL
    )
    client = redis_client(where, decode_responses=True, socket_timeout=5, socket_connect_timeout=5)
    assert master_address(client) is None  # not connected yet
    assert await client.ping()
    assert master_address(client) == ("127.0.0.1", cluster.master_port)
    await client.aclose()
    plain = Redis(port=cluster.master_port)
    assert master_address(plain) is None
    await plain.aclose()


async def _wait_through_the_switch(client: AsyncClient, job_id: str) -> Job:
    for _ in range(200):
        try:
            return await client.wait(job_id, timeout=60)
        except (RedisConnectionError, ConnectionError):
            await asyncio.sleep(0.05)
    raise AssertionError(f"{job_id}: Redis never came back")


async def _collect(client: AsyncClient, job_id: str) -> list[TokenChunk]:
    return [chunk async for chunk in client.stream(job_id)]


async def _redis_failed(worker) -> bool:
    return worker.metrics.redis_errors.labels(MODEL)._value.get() > 0


async def _has_jobs(redis: Redis, jobs: list[Job]) -> bool:
    return await redis.exists(*(KEYS.job(job.id) for job in jobs)) == len(jobs)
