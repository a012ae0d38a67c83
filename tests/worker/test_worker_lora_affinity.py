"""LoRA adapters across workers, against a real redis-server with tiny random models: the
heartbeat tells the adapters in a worker's engine slots (resident) from those in its host memory
only (cached); a job for an adapter goes to the worker that holds it resident when that worker
has room, and otherwise (the holder gone quiet, or busy) runs on another within
`lora_affinity_wait_s`; every job runs once and none is lost."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
from redis.asyncio import Redis
from worker_harness import KEYS, running_worker, wait_for

from engine import LLM, SamplingParams
from engine.lora import LoRARequest
from engine.outputs import EngineStats
from producer_api.client.redis_client import AsyncRedisClient
from redis_io.scripts import run_script
from schemas import Job, JobStatus, WorkerInfo
from schemas.redis_scripts import LORA_OFFER_SCRIPT, LORA_TAKE_SCRIPT
from tests.engine.conftest import save_tiny_model
from tests.engine.lora_reference import make_adapter
from worker.heartbeat import beat
from worker.lora_affinity import PEERS_MAX_AGE_S
from worker.worker import Worker

pytestmark = pytest.mark.anyio
MODEL = "tiny-lora-affinity"
PROMPT = [5, 17, 42, 7, 99, 3]
SAMPLING = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
WAIT_S = 1.0


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    base = save_tiny_model(tmp_path / "base", "llama")
    return {
        "base": base,
        "x": make_adapter(base, tmp_path / "x", seed=1),
        "y": make_adapter(base, tmp_path / "y", seed=2),
    }


def tiny_llm(folders: dict[str, Path], max_num_seqs: int = 256) -> LLM:
    """One adapter slot, two adapters in host memory."""
    return LLM(
        str(folders["base"]),
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_lora_rank=8,
        max_num_seqs=max_num_seqs,
    )


def modules(folders: dict[str, Path]) -> list[str]:
    return [f"{name}={folders[name]}" for name in ("x", "y")]


async def heartbeat(redis: Redis, name: str) -> WorkerInfo:
    return WorkerInfo.from_redis_hash(await redis.hgetall(KEYS.worker(name)))


@asynccontextmanager
async def lora_worker(
    redis_url: str, folders: dict[str, Path], llm: LLM, **overrides: object
) -> AsyncIterator[Worker]:
    settings = {"enable_lora": True, "lora_modules": modules(folders), **overrides}
    async with running_worker(redis_url, llm.engine, model=MODEL, **settings) as worker:
        yield worker


async def run_jobs(client: AsyncRedisClient, lora: str, count: int) -> list[Job]:
    jobs = await asyncio.gather(
        *(
            client.enqueue(model=MODEL, prompt_token_ids=PROMPT, sampling=SAMPLING, lora=lora)
            for _ in range(count)
        )
    )
    return [await client.wait(job.id, timeout=120) for job in jobs]


def assert_ran_once(done: list[Job], expected: list[int]) -> None:
    for job in done:
        assert job.status is JobStatus.SUCCEEDED, job.error
        assert job.attempts == 1
        assert job.result.choices[0].token_ids == expected


async def test_the_heartbeat_tells_resident_adapters_from_cached_ones(
    redis_url: str, folders: dict[str, Path]
) -> None:
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with (
        AsyncRedisClient(redis_url) as client,
        lora_worker(redis_url, folders, tiny_llm(folders)) as worker,
    ):
        await wait_for(lambda: redis.exists(KEYS.worker(worker.name)), 10)
        info = await heartbeat(redis, worker.name)
        assert (info.lora_adapters, info.lora_resident, info.lora_cached) == (["x", "y"], [], [])

        async def shows(resident: list[str], cached: list[str]) -> bool:
            info = await heartbeat(redis, worker.name)
            return (info.lora_resident, info.lora_cached) == (resident, cached)

        await run_jobs(client, "x", 1)
        await wait_for(lambda: shows(["x"], []), 10)
        await run_jobs(client, "y", 1)  # one slot: y takes it, x stays in host memory
        await wait_for(lambda: shows(["y"], ["x"]), 10)
    await redis.aclose()


async def test_a_heartbeat_of_a_worker_that_does_not_tell_residency_still_reads(
    redis_url: str,
) -> None:
    redis = Redis.from_url(redis_url, decode_responses=True)
    stats = EngineStats(10, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    now = datetime.now(UTC)
    await beat(
        redis, KEYS, name="old", model=MODEL, stats=stats, started_at=now, ttl_s=30,
        lora_adapters=["x"],
    )  # fmt: skip
    await redis.hdel(KEYS.worker("old"), "lora_resident", "lora_cached")
    info = await heartbeat(redis, "old")
    await redis.aclose()
    assert (info.lora_adapters, info.lora_resident, info.lora_cached) == (["x"], [], [])


async def test_jobs_for_an_adapter_go_to_the_worker_that_holds_it(
    redis_url: str, folders: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    holder_llm = tiny_llm(folders)
    expected = (
        holder_llm.generate(
            [PROMPT],
            SamplingParams(**SAMPLING),
            use_tqdm=False,
            lora_request=LoRARequest("x", 1, str(folders["x"])),
        )[0]
        .outputs[0]
        .token_ids
    )
    caplog.set_level(logging.INFO, logger="worker.lora_affinity")
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(AsyncRedisClient(redis_url))
        holder = await stack.enter_async_context(
            lora_worker(redis_url, folders, holder_llm, lora_affinity_wait_s=30.0)
        )
        await run_jobs(client, "x", 1)  # x is resident on the holder now

        async def holds_x() -> bool:
            return (await heartbeat(redis, holder.name)).lora_resident == ["x"]

        await wait_for(holds_x, 10)
        other = await stack.enter_async_context(
            lora_worker(redis_url, folders, tiny_llm(folders), lora_affinity_wait_s=30.0)
        )
        await wait_for(lambda: redis.exists(KEYS.worker(other.name)), 10)

        async def holder_idle() -> bool:
            info = await heartbeat(redis, holder.name)
            return info.running == 0 and info.waiting == 0

        rounds, per_round = 3, 4
        for _ in range(rounds):  # each round: both workers idle, both reading
            await wait_for(holder_idle, 10)
            await asyncio.sleep(PEERS_MAX_AGE_S)  # the other's view of it is fresh too
            done = await run_jobs(client, "x", per_round)
            assert_ran_once(done, list(expected))
            assert {job.worker for job in done} == {holder.name}
        assert other.outcomes.get("succeeded", 0) == 0
        offered = [r for r in caplog.records if r.getMessage().startswith("lora_job_offered")]
        assert offered  # the other worker read some of them, and left them to the holder
        assert holder.outcomes["succeeded"] == 1 + rounds * per_round
        assert not await redis.exists(KEYS.lora_offers(MODEL))
    await redis.aclose()


async def test_without_a_holder_that_takes_them_jobs_run_elsewhere_within_the_wait(
    redis_url: str, folders: dict[str, Path]
) -> None:
    """A holder that advertises x resident with room but never reads again (it died after its
    last heartbeat, or stalled): the worker that read the jobs runs them once the wait ends."""
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with (
        AsyncRedisClient(redis_url) as client,
        lora_worker(redis_url, folders, tiny_llm(folders), lora_affinity_wait_s=WAIT_S) as worker,
    ):
        await wait_for(lambda: redis.exists(KEYS.worker(worker.name)), 10)
        await quiet_holder(redis, ["x"])
        started = time.monotonic()
        done = await run_jobs(client, "x", 3)
        elapsed = time.monotonic() - started
        others = await run_jobs(client, "y", 1)  # y: held by no one, runs here at once
    await redis.aclose()
    for job in [*done, *others]:
        assert job.status is JobStatus.SUCCEEDED, job.error
        assert job.attempts == 1
        assert job.worker == worker.name
    waits = [(job.started_at - job.created_at).total_seconds() for job in done]
    assert min(waits) >= WAIT_S * 0.9  # they were offered to the holder first
    assert elapsed < WAIT_S + 30  # and did not wait for it beyond the bound (plus the run)
    assert worker.outcomes["succeeded"] == 4


async def test_jobs_a_busy_holder_has_no_room_for_run_elsewhere_within_the_wait(
    redis_url: str, folders: dict[str, Path]
) -> None:
    """The holder runs one sequence at a time and is busy with a long job: the other worker
    offers it the new jobs for its adapter, and runs them itself when the wait ends."""
    holder_llm = tiny_llm(folders, max_num_seqs=1)
    real_step = holder_llm.engine.step

    def slow_step() -> list:  # a long job that stays long on a fast machine
        time.sleep(0.02)
        return real_step()

    holder_llm.engine.step = slow_step  # type: ignore[method-assign]
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(AsyncRedisClient(redis_url))
        holder = await stack.enter_async_context(
            lora_worker(redis_url, folders, holder_llm, lora_affinity_wait_s=WAIT_S)
        )
        await run_jobs(client, "x", 1)
        long_sampling = {**SAMPLING, "max_tokens": 400}
        long_job = await client.enqueue(
            model=MODEL, prompt_token_ids=PROMPT, sampling=long_sampling, lora="x"
        )

        async def holder_full() -> bool:
            info = await heartbeat(redis, holder.name)
            return info.running == 1 and info.lora_resident == ["x"]

        await wait_for(holder_full, 10)
        other = await stack.enter_async_context(
            lora_worker(redis_url, folders, tiny_llm(folders), lora_affinity_wait_s=WAIT_S)
        )
        await wait_for(lambda: redis.exists(KEYS.worker(other.name)), 10)
        done = await run_jobs(client, "x", 2)
        assert (await client.get(long_job.id)).status is JobStatus.RUNNING
        await client.cancel(long_job.id)
    await redis.aclose()
    for job in done:
        assert job.status is JobStatus.SUCCEEDED, job.error
        assert job.attempts == 1
        assert job.worker == other.name
        assert (job.started_at - job.created_at).total_seconds() >= WAIT_S * 0.9
    assert other.outcomes["succeeded"] == len(done)


async def quiet_holder(redis: Redis, resident: list[str]) -> None:
    """A worker of the model that advertises `resident` with room and never reads."""
    await redis.xgroup_createconsumer(KEYS.jobs_stream(MODEL), KEYS.group, "quiet-holder")
    await beat(
        redis, KEYS, name="quiet-holder", model=MODEL,
        stats=EngineStats(10, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0), started_at=datetime.now(UTC),
        ttl_s=60, lora_adapters=["x", "y"], lora_resident=resident,
    )  # fmt: skip


async def test_a_stopping_worker_hands_back_the_jobs_it_offered(
    redis_url: str, folders: dict[str, Path]
) -> None:
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with AsyncRedisClient(redis_url) as client:
        async with lora_worker(
            redis_url, folders, tiny_llm(folders), lora_affinity_wait_s=60.0
        ) as first:
            await wait_for(lambda: redis.exists(KEYS.worker(first.name)), 10)
            await quiet_holder(redis, ["x"])
            jobs = [
                await client.enqueue(
                    model=MODEL, prompt_token_ids=PROMPT, sampling=SAMPLING, lora="x"
                )
                for _ in range(2)
            ]

            async def offered() -> bool:
                return await redis.zcard(KEYS.lora_offers(MODEL)) == len(jobs)

            await wait_for(offered, 10)
        assert not await redis.exists(KEYS.lora_offers(MODEL))
        async with lora_worker(
            redis_url, folders, tiny_llm(folders), lora_affinity_wait_s=0
        ) as second:
            done = [await client.wait(job.id, timeout=60) for job in jobs]
    await redis.aclose()
    for job in done:
        assert job.status is JobStatus.SUCCEEDED, job.error
        assert (job.worker, job.attempts) == (second.name, 1)
    assert first.outcomes.get("succeeded", 0) == 0


async def test_an_offer_whose_entry_changed_hands_is_never_taken(redis_url: str) -> None:
    """The offering worker died and the janitor gave its entry to another: a holder that comes
    for the offer afterwards gets nothing, so the job runs once."""
    redis = Redis.from_url(redis_url, decode_responses=True)
    stream, bulk, offers = (
        KEYS.jobs_stream(MODEL),
        KEYS.bulk_stream(MODEL),
        KEYS.lora_offers(MODEL),
    )
    await redis.xgroup_create(stream, KEYS.group, id="0", mkstream=True)
    await redis.xgroup_create(bulk, KEYS.group, id="0", mkstream=True)
    entry = await redis.xadd(stream, {"job": "j1"})
    await redis.xreadgroup(KEYS.group, "offerer", {stream: ">"})
    member = f"j|{entry}|x|offerer"
    await run_script(redis, LORA_OFFER_SCRIPT, [offers], [member, 60_000, 120_000])
    await redis.xclaim(stream, KEYS.group, "janitor", 0, [entry])  # the offerer died
    taken = await run_script(
        redis, LORA_TAKE_SCRIPT, [offers, stream, bulk], [KEYS.group, "holder", 5, 60_000, "x"]
    )
    pending = await redis.xpending_range(stream, KEYS.group, min="-", max="+", count=5)
    await redis.aclose()
    assert taken == [[], []]
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(entry, "janitor")]
