"""A worker serving LoRA adapters on a tiny random model, against a real redis-server: a job
names its adapter, runs with it (the same tokens as offline `LLM.generate` with that adapter),
an adapter that cannot load fails its job alone with `invalid_lora_adapter`, and adapters loaded
at run time through the model's registry reach the worker and its heartbeat."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis.asyncio import Redis
from worker_harness import KEYS, running_worker, wait_for

from engine import LLM, SamplingParams
from engine.lora import LoRARequest
from producer_api.client.redis_client import AsyncRedisClient
from schemas import ControlMessage, ErrorCode, JobStatus, WorkerInfo
from tests.engine.conftest import save_tiny_model
from tests.engine.lora_reference import make_adapter

pytestmark = pytest.mark.anyio
MODEL = "tiny-lora"
PROMPT = [5, 17, 42, 7, 99, 3]
SAMPLING = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    base = save_tiny_model(tmp_path / "base", "llama")
    return {
        "base": base,
        "a": make_adapter(base, tmp_path / "a", seed=1),
        "b": make_adapter(base, tmp_path / "b", seed=2),
        "big": make_adapter(base, tmp_path / "big", seed=3, rank=16),  # > max_lora_rank
    }


def offline(llm: LLM, lora: LoRARequest | None) -> list[int]:
    params = SamplingParams(**SAMPLING)
    out = llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)
    return list(out[0].outputs[0].token_ids)


async def heartbeat(redis: Redis, name: str) -> WorkerInfo:
    return WorkerInfo.from_redis_hash(await redis.hgetall(KEYS.worker(name)))


async def test_jobs_run_with_their_adapter_and_a_bad_one_fails_alone(
    redis_url: str, folders: dict[str, Path]
) -> None:
    llm = LLM(str(folders["base"]), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    expected_a = offline(llm, LoRARequest("a", 1, str(folders["a"])))
    expected_base = offline(llm, None)
    assert expected_a != expected_base  # the adapter changes the output
    modules = [f"{name}={folders[name]}" for name in ("a", "b", "big")]
    modules.append(f"missing={folders['base'] / 'nowhere'}")
    redis = Redis.from_url(redis_url, decode_responses=True)
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(
            redis_url, llm.engine, model=MODEL, enable_lora=True, lora_modules=modules
        ) as worker,
    ):
        await wait_for(lambda: redis.exists(KEYS.worker(worker.name)), 10)
        info = await heartbeat(redis, worker.name)
        assert info.lora_adapters == ["a", "b", "big", "missing"]
        loras = ["a", None, "big", "missing", "unknown", "a"]
        jobs = await asyncio.gather(
            *(
                client.enqueue(model=MODEL, prompt_token_ids=PROMPT, sampling=SAMPLING, lora=lora)
                for lora in loras
            )
        )
        done = [await client.wait(job.id, timeout=120) for job in jobs]
    await redis.aclose()
    by_lora = dict(zip(loras, done, strict=False))
    for job in (done[0], done[5]):
        assert job.status is JobStatus.SUCCEEDED, job.error
        assert job.result.choices[0].token_ids == expected_a
    assert by_lora[None].status is JobStatus.SUCCEEDED
    assert by_lora[None].result.choices[0].token_ids == expected_base
    for lora, problem in (("big", "max_lora_rank"), ("missing", "nowhere"), ("unknown", "unknown")):
        job = by_lora[lora]
        assert job.status is JobStatus.FAILED
        assert job.error.code is ErrorCode.INVALID_LORA_ADAPTER
        assert problem in job.error.message


async def test_adapters_loaded_and_unloaded_at_run_time_reach_the_worker(
    redis_url: str, folders: dict[str, Path]
) -> None:
    llm = LLM(str(folders["base"]), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    expected_b = offline(llm, LoRARequest("b", 1, str(folders["b"])))
    redis = Redis.from_url(redis_url, decode_responses=True)
    announce = ControlMessage(op="lora", model=MODEL).to_json()
    async with (
        AsyncRedisClient(redis_url) as client,
        running_worker(redis_url, llm.engine, model=MODEL, enable_lora=True) as worker,
    ):
        await wait_for(lambda: redis.exists(KEYS.worker(worker.name)), 10)
        await redis.hset(KEYS.lora_registry(MODEL), "b", str(folders["b"]))
        await redis.publish(KEYS.control_channel(), announce)

        async def advertised(names: list[str]) -> bool:
            return (await heartbeat(redis, worker.name)).lora_adapters == names

        await wait_for(lambda: advertised(["b"]), 10)
        job = await client.enqueue(
            model=MODEL, prompt_token_ids=PROMPT, sampling=SAMPLING, lora="b"
        )
        done = await client.wait(job.id, timeout=60)
        assert done.status is JobStatus.SUCCEEDED, done.error
        assert done.result.choices[0].token_ids == expected_b
        await redis.hset(KEYS.lora_registry(MODEL), "b", "")  # unloaded
        await redis.publish(KEYS.control_channel(), announce)
        await wait_for(lambda: advertised([]), 10)
        job = await client.enqueue(
            model=MODEL, prompt_token_ids=PROMPT, sampling=SAMPLING, lora="b"
        )
        done = await client.wait(job.id, timeout=60)
        assert done.status is JobStatus.FAILED
        assert done.error.code is ErrorCode.INVALID_LORA_ADAPTER
    await redis.aclose()
