"""The Batch API against the real system: Redis, the API, an arq controller process and
an inference worker process on the default model. Texts must equal the offline `engine.LLM`'s.

Run with `pytest tests/batch -m slow -s` (prints the batch durations; the priority acceptance is
in test_priority_acceptance.py)."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from redis import Redis

from schemas import RedisKeys
from tests.batch.real_system import (
    MAX_MODEL_LEN,
    MODEL,
    RealSystem,
    completion_line,
    running_system,
    start_controller,
    stop,
)

pytestmark = [pytest.mark.slow, pytest.mark.model]

KEYS = RedisKeys()
MAX_TOKENS = 8
LINES = 300
PROMPTS = [f"Question {i}: what comes after the number {i * 7}?" for i in range(LINES)]
BULK_MAX_HELD = 8  # bulk sequences the worker runs at once


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    from engine import LLM, SamplingParams

    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN)
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    texts = {f"q-{i}": out.outputs[0].text for i, out in enumerate(outputs)}
    del llm
    return texts


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> Iterator[RealSystem]:
    with running_system(
        tmp_path_factory.mktemp("redis-batch"), bulk_max_held=BULK_MAX_HELD
    ) as real:
        yield real


def lines_for(count: int) -> list[str]:
    return [completion_line(f"q-{i}", PROMPTS[i], MAX_TOKENS) for i in range(count)]


def batch_jobs(redis: Redis, batch_id: str) -> list[dict[str, str]]:
    jobs = []
    for key in redis.scan_iter(KEYS.job_key_prefix() + "*", count=1000):
        job = redis.hgetall(key)
        if f'"batch_id":"{batch_id}"' in job.get("request", ""):
            jobs.append(job)
    return jobs


def test_300_line_batch_matches_the_offline_engine(system: RealSystem, reference):
    controller = start_controller(system.server.url)
    try:
        lines = lines_for(LINES)
        lines.insert(100, '{"custom_id": "broken", "method": "POST"')  # cut off
        lines.insert(200, completion_line("no-prompt", "x", 4).replace('"prompt"', '"promt"'))
        started = time.monotonic()
        created = system.submit(lines)
        done = system.wait(created["id"], {"completed", "failed"})
        elapsed = time.monotonic() - started
    finally:
        stop(controller)
    print(f"\n300-line batch ({MAX_TOKENS} tokens each): {elapsed:.1f} s")
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": LINES + 2, "completed": LINES, "failed": 2}
    output = system.content(done["output_file_id"])
    assert Counter(r["custom_id"] for r in output) == Counter(set(reference))
    for record in output:
        assert record["response"]["body"]["choices"][0]["text"] == reference[record["custom_id"]]
    errors = {e["custom_id"]: e["error"] for e in system.content(done["error_file_id"])}
    assert errors[None]["line"] == 101 and "not valid JSON" in errors[None]["message"]
    assert "prompt" in errors["no-prompt"]["message"]


def test_killed_controller_resumes_without_duplicates(system: RealSystem, reference, redis):
    count = 150
    controller = start_controller(system.server.url)
    created = system.submit(lines_for(count))
    try:
        system.wait_completed(created["id"], 20)
    finally:
        stop(controller, signal.SIGKILL)
    killed_at = system.batch(created["id"])
    assert killed_at["status"] == "in_progress"
    time.sleep(1.0)
    controller = start_controller(system.server.url)
    try:
        done = system.wait(created["id"], {"completed", "failed"})
    finally:
        stop(controller)
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": count, "completed": count, "failed": 0}
    output = system.content(done["output_file_id"])
    assert Counter(r["custom_id"] for r in output) == Counter({f"q-{i}": 1 for i in range(count)})
    for record in output:
        assert record["response"]["body"]["choices"][0]["text"] == reference[record["custom_id"]]
    # one job per line: the re-run found the jobs the killed run had enqueued
    jobs = batch_jobs(redis, created["id"])
    assert len(jobs) == count
    assert all(job["status"] == "succeeded" for job in jobs)


def test_cancel_mid_way_keeps_partial_output_and_runs_nothing_more(
    system: RealSystem, reference, redis
):
    controller = start_controller(system.server.url)
    try:
        created = system.submit(lines_for(200))
        system.wait_completed(created["id"], 10)
        response = system.http.post(f"/v1/batches/{created['id']}/cancel")
        assert response.status_code == 200 and response.json()["status"] in (
            "cancelling",
            "cancelled",
        )
        done = system.wait(created["id"], {"cancelled"})
    finally:
        stop(controller)
    output = system.content(done["output_file_id"])
    errors = system.content(done["error_file_id"])
    assert 10 <= len(output) < 200
    for record in output:
        assert record["response"]["body"]["choices"][0]["text"] == reference[record["custom_id"]]
    assert Counter(r["custom_id"] for r in output + errors) == Counter(
        {f"q-{i}": 1 for i in range(200)}
    )
    assert redis.xlen(KEYS.bulk_stream(MODEL)) == 0
    jobs_then = {job["id"]: job["status"] for job in batch_jobs(redis, created["id"])}
    assert all(status in ("succeeded", "cancelled") for status in jobs_then.values())
    time.sleep(2.0)
    jobs_now = {job["id"]: job["status"] for job in batch_jobs(redis, created["id"])}
    assert jobs_now == jobs_then  # no job of the batch ran after the cancel
    assert sum(status == "succeeded" for status in jobs_now.values()) == len(output)
