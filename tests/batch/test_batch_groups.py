"""Embedding lines run in groups, one job of several inputs each: every line gets its own
input's vector, a controller killed at the worst moment (its group jobs enqueued, its record
of them not yet written) and run again still writes every line exactly once with no line in
two jobs, and a group whose job fails runs its lines again one job each, so only the bad line
fails. BatchRunner runs in this process against a stand-in worker that ends each job as it is
enqueued (no model needed)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest
from redis.asyncio import Redis

from producer_api import queue
from producer_api.batches import fan_out as fan_out_module
from producer_api.batches.files import BATCH_PURPOSE, FileStore
from producer_api.batches.runner import BatchRunner, Lease
from producer_api.batches.settings import BatchControllerSettings
from producer_api.batches.store import BatchStore
from redis_io.clients import redis_client
from schemas import ErrorBody, ErrorCode, Job, JobField, JobRequest, JobStatus, RedisKeys
from schemas.batches import BATCH_LINES_METADATA, format_line_numbers, parse_line_numbers
from schemas.jobs import encode_hash_value
from schemas.results import ChoiceResult, JobResult, Timings, Usage

T0 = datetime(2030, 1, 1, tzinfo=UTC)
KEYS = RedisKeys()
POISON = "POISON"
_ENQUEUE_ALL = fan_out_module.enqueue_all


class Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs (not an Exception: no handler catches it)."""


def _vector(text: str) -> list[float]:
    """The stand-in model's vector of a text: its document number, then its length."""
    return [float(text.split(":")[0].split()[-1]), float(len(text))]


def _result(inputs: list[str]) -> JobResult:
    return JobResult(
        choices=[ChoiceResult(index=0, text="", token_ids=[], finish_reason="stop")],
        usage=Usage.of(2 * len(inputs), 0, 0),
        timings=Timings.from_times(T0, T0, None, T0),
        embeddings=[_vector(text) for text in inputs],
        input_tokens=[2] * len(inputs),
    )


def _single_result(text: str) -> JobResult:
    return JobResult(
        choices=[ChoiceResult(index=0, text="", token_ids=[], finish_reason="stop")],
        usage=Usage.of(2, 0, 0),
        timings=Timings.from_times(T0, T0, None, T0),
        embedding=_vector(text),
    )


def _ends(request: JobRequest) -> dict[str, str]:
    """What the stand-in worker writes into a job's hash: a vector per input, or a failure
    when an input is poisoned (a worker refuses the whole job, as for an input it cannot run)."""
    texts = [t for t in (request.inputs or [request.prompt]) if isinstance(t, str)]
    if any(POISON in text for text in texts):
        error = ErrorBody.of(ErrorCode.INVALID_REQUEST, "inputs: a poisoned input")
        return {JobField.STATUS: JobStatus.FAILED.value, JobField.ERROR: encode_hash_value(error)}
    result = _result(texts) if request.inputs is not None else _single_result(texts[0])
    return {JobField.STATUS: JobStatus.SUCCEEDED.value, JobField.RESULT: encode_hash_value(result)}


def _stand_in_worker(monkeypatch: pytest.MonkeyPatch, kill_at_call: int | None = None) -> None:
    """Every job enqueued ends at once, announced to its batch. With `kill_at_call`, that call
    of enqueue_all enqueues its jobs and then the run dies before it records them."""
    calls = 0

    async def enqueue_and_end(
        redis: Redis, keys: RedisKeys, requests: list[JobRequest], **kwargs: Any
    ) -> list[Job | BaseException]:
        nonlocal calls
        calls += 1
        results = await _ENQUEUE_ALL(redis, keys, requests, **kwargs)
        if calls == kill_at_call:
            raise Killed
        async with redis.pipeline(transaction=False) as pipe:
            for request, job in zip(requests, results, strict=True):
                assert isinstance(job, Job)
                pipe.hset(keys.job(job.id), mapping=_ends(request))
                pipe.rpush(keys.batch_ended(request.metadata["batch_id"]), job.id)
            await pipe.execute()
        return results

    async def no_backlog(*args: object, **kwargs: object) -> int:
        return 0

    monkeypatch.setattr(fan_out_module, "enqueue_all", enqueue_and_end)
    monkeypatch.setattr(queue, "queue_length", no_backlog)


def _text(i: int) -> str:
    return f"Document {i}: notes on queues" + (f" {POISON}" if i == 77 else "")


def _input(count: int, *, poison: bool = False) -> str:
    rows = []
    for i in range(count):
        text = _text(i) if poison else _text(i).replace(f" {POISON}", "")
        body: dict[str, Any] = {"model": "m", "input": text}
        if 40 <= i < 45:
            body["dimensions"] = 1  # other pooling options: a group of their own
        rows.append(
            {"custom_id": f"d-{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
        )
        if i == 10:
            rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": "m", "input": ""}})  # fmt: skip
    return "".join(json.dumps(row) + "\n" for row in rows)


async def _batch(redis: Redis, settings: BatchControllerSettings, text: str) -> str:
    stored = await FileStore(redis, KEYS).save(
        owner=None,
        filename="in.jsonl",
        purpose=BATCH_PURPOSE,
        content=text.encode(),
        created_at=int(time.time()),
        ttl_s=3600,
    )
    batch = await BatchStore(redis, KEYS).create(
        owner=None,
        endpoint="/v1/embeddings",
        input_file_id=stored.id,
        completion_window="24h",
        window_s=86400,
        metadata=None,
    )
    return batch.id


async def _run(redis: Redis, settings: BatchControllerSettings, batch_id: str) -> bool:
    lease = Lease(redis, KEYS.batch_lease(batch_id), settings.batch_lease_s)
    assert await lease.acquire()
    try:
        return await BatchRunner(redis, KEYS, settings, batch_id).advance(
            time.monotonic() + 60, lease
        )
    finally:
        await lease.release()


async def _outcome(redis: Redis, batch_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The batch's record and its output and error lines (every line of both files)."""
    record = await redis.hgetall(KEYS.batch(batch_id))
    files = FileStore(redis, KEYS)
    rows: list[dict[str, Any]] = []
    for field in ("output_file_id", "error_file_id"):
        if record.get(field):
            content = await files.content(record[field])
            assert content is not None
            rows += [json.loads(line) for line in content.splitlines() if line.strip()]
    return record, rows


async def _lines_per_job(redis: Redis) -> Counter[int]:
    """How many jobs in Redis carry each line (a group's lines, or a single line's)."""
    carried: Counter[int] = Counter()
    async for key in redis.scan_iter(match=KEYS.job_key_prefix() + "*"):
        data = await redis.hgetall(key)
        if "request" not in data:
            continue
        job = Job.from_redis_hash(data)
        names = job.request.metadata.get(BATCH_LINES_METADATA)
        if names is not None:
            carried.update(parse_line_numbers(names))
        else:
            carried[int(job.request.idempotency_key.rsplit(":", 1)[1])] += 1  # type: ignore[union-attr]
    return carried


def _check_every_line_once_with_its_vector(rows: list[dict[str, Any]], count: int) -> None:
    by_id = Counter(row["custom_id"] for row in rows)
    assert by_id == Counter([f"d-{i}" for i in range(count)] + ["bad"])
    for row in rows:
        if row["custom_id"] == "bad":
            assert row["error"] is not None
            continue
        i = int(row["custom_id"][2:])
        body = row["response"]["body"]
        (item,) = body["data"]
        assert item["embedding"] == _vector(_text(i).replace(f" {POISON}", ""))
        assert body["usage"]["prompt_tokens"] == 2


def test_line_numbers_are_written_as_runs_and_read_back() -> None:
    for numbers in ([1], [3, 4, 5, 9], [1, 3, 5], [99_999, 100_000, 100_002]):
        assert parse_line_numbers(format_line_numbers(numbers)) == numbers
    assert format_line_numbers([3, 4, 5, 9]) == "3-5,9"
    with pytest.raises(ValueError):
        parse_line_numbers("5-3")


def test_grouped_lines_each_get_their_own_vector_in_few_jobs(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stand_in_worker(monkeypatch)
    settings = BatchControllerSettings(redis_url=redis_url, batch_poll_interval_s=0.01)

    async def main() -> None:
        redis = redis_client(settings)
        try:
            batch_id = await _batch(redis, settings, _input(150))
            assert await _run(redis, settings, batch_id)
            record, rows = await _outcome(redis, batch_id)
            assert record["status"] == "completed"
            assert (record["completed"], record["failed"]) == ("150", "1")  # the bad line
            _check_every_line_once_with_its_vector(rows, 150)
            jobs = {row["response"]["request_id"] for row in rows if row["custom_id"] != "bad"}
            # slots of 64 valid lines, the 5 lines with other pooling options apart: 5 jobs
            assert len(jobs) == 5
            assert set((await _lines_per_job(redis)).values()) == {1}
        finally:
            await redis.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("kill_at_call", [1, 2])
def test_a_controller_killed_after_enqueueing_groups_writes_every_line_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, kill_at_call: int
) -> None:
    settings = BatchControllerSettings(
        redis_url=redis_url, batch_poll_interval_s=0.01, batch_chunk_lines=64
    )

    async def main() -> None:
        redis = redis_client(settings)
        try:
            batch_id = await _batch(redis, settings, _input(150))
            _stand_in_worker(monkeypatch, kill_at_call=kill_at_call)
            with pytest.raises(Killed):
                await _run(redis, settings, batch_id)
            _stand_in_worker(monkeypatch)  # the next run, undisturbed
            assert await _run(redis, settings, batch_id)
            record, rows = await _outcome(redis, batch_id)
            assert record["status"] == "completed"
            _check_every_line_once_with_its_vector(rows, 150)
            carried = await _lines_per_job(redis)
            assert set(carried) == set(range(1, 152)) - {12}  # every valid line, in one job
            assert set(carried.values()) == {1}
        finally:
            await redis.aclose()

    asyncio.run(main())


def test_a_failed_group_runs_its_lines_alone_and_only_the_bad_line_fails(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stand_in_worker(monkeypatch)
    settings = BatchControllerSettings(redis_url=redis_url, batch_poll_interval_s=0.01)

    async def main() -> None:
        redis = redis_client(settings)
        try:
            batch_id = await _batch(redis, settings, _input(150, poison=True))
            assert await _run(redis, settings, batch_id)
            record, rows = await _outcome(redis, batch_id)
            assert record["status"] == "completed"
            assert (record["completed"], record["failed"]) == ("149", "2")  # and the bad line
            by_id = {row["custom_id"]: row for row in rows}
            assert len(rows) == len(by_id) == 151
            assert by_id["d-77"]["error"]["code"] == "invalid_request"
            assert "poisoned" in by_id["d-77"]["error"]["message"]
            for i in range(150):
                if i != 77:
                    (item,) = by_id[f"d-{i}"]["response"]["body"]["data"]
                    assert item["embedding"] == _vector(_text(i).replace(f" {POISON}", ""))
        finally:
            await redis.aclose()

    asyncio.run(main())


def test_a_cancelled_batch_writes_each_grouped_line_once_finished_or_not_run(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first round's groups finish, the next are queued when the cancel comes: their jobs
    are cancelled (not run again one by one) and every line is in exactly one file."""
    settings = BatchControllerSettings(
        redis_url=redis_url, batch_poll_interval_s=0.01, batch_chunk_lines=64
    )
    calls = 0

    async def enqueue_then_cancel(
        redis: Redis, keys: RedisKeys, requests: list[JobRequest], **kwargs: Any
    ) -> list[Job | BaseException]:
        nonlocal calls
        calls += 1
        results = await _ENQUEUE_ALL(redis, keys, requests, **kwargs)
        batch_id = requests[0].metadata["batch_id"]
        if calls == 1:  # the first round's groups run and end
            async with redis.pipeline(transaction=False) as pipe:
                for request, job in zip(requests, results, strict=True):
                    assert isinstance(job, Job)
                    pipe.hset(keys.job(job.id), mapping=_ends(request))
                    pipe.rpush(keys.batch_ended(batch_id), job.id)
                await pipe.execute()
        else:  # the next stay queued: the client cancels the batch meanwhile
            await redis.hset(keys.batch(batch_id), "status", "cancelling")
        return results

    async def no_backlog(*args: object, **kwargs: object) -> int:
        return 0

    monkeypatch.setattr(fan_out_module, "enqueue_all", enqueue_then_cancel)
    monkeypatch.setattr(queue, "queue_length", no_backlog)

    async def main() -> None:
        redis = redis_client(settings)
        try:
            batch_id = await _batch(redis, settings, _input(150))
            assert await _run(redis, settings, batch_id)
            record, rows = await _outcome(redis, batch_id)
            assert record["status"] == "cancelled"
            by_id = Counter(row["custom_id"] for row in rows)
            assert by_id == Counter([f"d-{i}" for i in range(150)] + ["bad"])
            done = [row for row in rows if row["error"] is None]
            # the first fan-out round (64 lines: three groups) ran
            assert {row["custom_id"] for row in done} == {f"d-{i}" for i in range(64)}
            for row in done:
                (item,) = row["response"]["body"]["data"]
                assert item["embedding"] == _vector(_text(int(row["custom_id"][2:])))
            codes = Counter(row["error"]["code"] for row in rows if row["error"] is not None)
            assert set(codes) <= {"cancelled", "batch_cancelled", "invalid_request"}
            assert sum(codes.values()) == 87  # 86 cancelled or never run, and the bad line
            assert set((await _lines_per_job(redis)).values()) == {1}  # none ran again alone
        finally:
            await redis.aclose()

    asyncio.run(main())
