"""The Batch API with LoRA adapters, on the fake engine: a line whose model names an adapter a
worker advertises runs on the base model's queue with the adapter in its job."""

from __future__ import annotations

import json

from redis import Redis

from schemas import Job, RedisKeys
from tests.batch.conftest import FAKE_MODEL, BatchStack

KEYS = RedisKeys()


def line(custom_id: str, model: str) -> str:
    body = {"model": model, "prompt": f"prompt {custom_id}", "max_tokens": 3, "temperature": 0}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    )


def test_batch_lines_for_an_adapter_run_on_its_base_model(batch_stack: BatchStack):
    lines = [line("base", FAKE_MODEL), line("ad", "batch-lora")]
    uploaded = batch_stack.upload("\n".join(lines) + "\n")
    batch_stack.start_worker(enable_lora=True, lora_modules=["batch-lora=/adapters/batch"])
    batch_stack.start_controller()
    created = batch_stack.create(uploaded["id"])
    done = batch_stack.wait(created["id"], {"completed", "failed"})
    assert done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}, done
    output = {r["custom_id"]: r for r in batch_stack.content(done["output_file_id"])}
    assert set(output) == {"base", "ad"}
    redis = Redis.from_url(batch_stack.redis_url, decode_responses=True)
    try:
        jobs = {
            cid: Job.from_redis_hash(redis.hgetall(KEYS.job(record["response"]["request_id"])))
            for cid, record in output.items()
        }
    finally:
        redis.close()
    assert (jobs["base"].request.model, jobs["base"].request.lora) == (FAKE_MODEL, None)
    assert (jobs["ad"].request.model, jobs["ad"].request.lora) == (FAKE_MODEL, "batch-lora")
