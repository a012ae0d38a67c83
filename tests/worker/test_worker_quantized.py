"""The default model's shipped 4-bit GGUF weights: a worker on them (slow) serves a streamed
job with the offline gguf engine's greedy text and says so in its heartbeat and start-up log;
and under one `memory_budget` the smaller weights leave room for more KV blocks."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from worker_harness import KEYS, start_worker_process, stop_process, stream_all

from engine import LLM, Engine, EngineConfig, SamplingParams
from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobStatus, WorkerInfo

pytestmark = [pytest.mark.anyio, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"
MEMORY_BUDGET = 1 << 30  # weights + KV cache
PROMPT = "The capital of France is"
MAX_TOKENS = 8  # few: the quantized matmul may still dequantize on every call


@pytest.fixture(scope="module")
def gguf_llm() -> LLM:
    """The offline reference, as the worker runs it (float32 activations, as every test)."""
    return LLM(MODEL, dtype="float32", quantization="gguf", memory_budget=MEMORY_BUDGET)


@pytest.mark.slow
async def test_gguf_worker_serves_a_streamed_job_and_advertises_gguf(redis_url, gguf_llm):
    greedy = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    (want,) = gguf_llm.generate([PROMPT], SamplingParams(**greedy), use_tqdm=False)
    process = start_worker_process(
        redis_url, fake=False, model=MODEL, name="gguf-worker", quantization="gguf"
    )
    redis = Redis.from_url(redis_url, decode_responses=True)
    try:
        async with AsyncRedisClient(redis_url) as client:
            job = await client.enqueue(model=MODEL, prompt=PROMPT, stream=True, sampling=greedy)
            chunks = await stream_all(client, job.id)
            done = await client.wait(job.id, timeout=300)
        assert done.status is JobStatus.SUCCEEDED, done
        assert [t for c in chunks for t in c.token_ids] == want.outputs[0].token_ids
        assert "".join(c.text for c in chunks) == done.result.choices[0].text
        assert done.result.choices[0].text == want.outputs[0].text
        assert chunks[-1].final

        info = WorkerInfo.from_redis_hash(await redis.hgetall(KEYS.worker("gguf-worker")))
        assert info.quantization == "gguf"
        assert info.weight_bytes == gguf_llm.engine.weight_bytes
        assert info.architecture == "LlamaForCausalLM"  # SmolLM2
    finally:
        await asyncio.to_thread(stop_process, process)
        await redis.aclose()
    log = process.log_path.read_text()
    started = next(line for line in log.splitlines() if "worker_started" in line)
    assert "quantization=gguf" in started
    assert f"weight_mib={gguf_llm.engine.weight_bytes / 2**20:.1f}" in started


def test_memory_budget_gives_gguf_weights_more_kv_blocks():
    # Eager: the forward's compiled glue does not change the cache size, and takes seconds.
    same = dict(model=MODEL, dtype="float32", memory_budget=MEMORY_BUDGET, enforce_eager=True)
    gguf = Engine(EngineConfig(**same, quantization="gguf"))
    full = Engine(EngineConfig(**same))
    assert (gguf.quantization, full.quantization) == ("gguf", None)
    assert gguf.weight_bytes < full.weight_bytes
    assert gguf.stats().num_blocks_total > full.stats().num_blocks_total
