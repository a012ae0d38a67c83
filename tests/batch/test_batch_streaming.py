"""A batch run holds the lines in flight, not the whole file: it parses lines as they fan out,
keeps each only until its job is collected, and a resumed run (after its controller died)
finds the valid lines from the numbers validation stored, without parsing the file again.
Runs the controller's BatchRunner by hand (small rounds) against the API and a fake worker."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import pytest
from redis import Redis

from producer_api.batches import input_lines, lines, output_files
from producer_api.batches.runner import BatchRunner, Lease
from producer_api.batches.settings import BatchControllerSettings
from redis_io.clients import redis_client
from schemas import BatchField, RedisKeys
from tests.batch.conftest import BatchStack
from tests.batch.test_batch_api import completion_line, expected_text

IN_FLIGHT = 6
LINES = 40
BAD_AT = (5, 17)  # 1-based line numbers of the invalid lines


def _input() -> tuple[str, dict[str, str]]:
    prompts = {f"req-{i}": f"prompt number {i}" for i in range(LINES)}
    lines = [completion_line(cid, prompt) for cid, prompt in prompts.items()]
    for number in BAD_AT:
        lines.insert(number - 1, "{not json")
    return "\n".join(lines) + "\n", prompts


async def _advance(
    stack: BatchStack, batch_id: str, seconds: float, in_flight: int = IN_FLIGHT
) -> tuple[bool, int]:
    """One controller run for `seconds`; (batch done, most lines it held parsed at once)."""
    settings = BatchControllerSettings(
        redis_url=stack.redis_url,
        batch_chunk_lines=3,
        batch_max_in_flight=in_flight,
        batch_poll_interval_s=0.02,
    )
    redis = redis_client(settings)
    keys = RedisKeys()
    lease = Lease(redis, keys.batch_lease(batch_id), settings.batch_lease_s)
    assert await lease.acquire()
    run = BatchRunner(redis, keys, settings, batch_id)
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, len(run.input.parsed))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        done = await run.advance(time.monotonic() + seconds, lease)
    finally:
        watcher.cancel()
        await lease.release()
        await redis.aclose()
    return done, most


def test_a_run_holds_only_lines_in_flight_and_a_resumed_run_parses_no_file(
    batch_stack: BatchStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, prompts = _input()
    uploaded = batch_stack.upload(text)
    batch_stack.start_worker(step_seconds=0.01)
    created = batch_stack.create(uploaded["id"])
    batch_id = created["id"]

    done, most = batch_stack.bg.run(_advance(batch_stack, batch_id, 0.4), timeout=60)
    assert not done and 0 < most <= IN_FLIGHT
    raw = batch_stack.http.get(f"/v1/batches/{batch_id}").json()
    assert raw["status"] == "in_progress" and raw["request_counts"]["total"] == LINES + 2
    with Redis.from_url(batch_stack.redis_url, decode_responses=True) as redis:
        stored = redis.hget(RedisKeys().batch(batch_id), BatchField.INVALID_LINES)
    assert json.loads(stored) == list(BAD_AT)

    # The run "died"; the next one must not parse the whole file to find where it was.
    def no_full_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a resumed run parsed the whole input file")

    monkeypatch.setattr(input_lines, "iter_lines", no_full_parse)
    monkeypatch.setattr(output_files, "CHUNK_LINES", 7)  # the output file: several parts
    done, most = batch_stack.bg.run(_advance(batch_stack, batch_id, 60), timeout=90)
    assert done and most <= IN_FLIGHT

    final = batch_stack.http.get(f"/v1/batches/{batch_id}").json()
    assert final["status"] == "completed", final
    assert final["request_counts"] == {"total": LINES + 2, "completed": LINES, "failed": 2}
    output = batch_stack.content(final["output_file_id"])
    assert sorted(r["custom_id"] for r in output) == sorted(prompts)  # each line once
    for record in output:
        text = record["response"]["body"]["choices"][0]["text"]
        assert text == expected_text(prompts[record["custom_id"]])
    errors = batch_stack.content(final["error_file_id"])
    assert sorted(e["error"]["line"] for e in errors) == list(BAD_AT)

    # written a chunk of lines at a time, as parts: no one Redis value holds the whole file
    keys = RedisKeys()
    with Redis.from_url(batch_stack.redis_url, decode_responses=True) as redis:
        file_id = final["output_file_id"]
        assert redis.llen(keys.file_parts(file_id)) == -(-LINES // 7)
        assert not redis.hexists(keys.file(file_id), "content")
    downloaded = batch_stack.http.get(f"/v1/files/{file_id}/content")
    listed = batch_stack.http.get(f"/v1/files/{file_id}").json()
    assert listed["bytes"] == len(downloaded.content)
    assert downloaded.text.count("\n") == LINES


def test_a_batch_within_the_in_flight_cap_parses_each_line_once(
    batch_stack: BatchStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation keeps the lines it parsed (as many as may be in flight): fan-out and
    collection take those instead of parsing the lines again."""
    text, prompts = _input()
    uploaded = batch_stack.upload(text)  # the API's own parse of the upload is not counted
    parses: Counter[int] = Counter()
    parse_line = lines.parse_line

    def counted(number: int, *args: object) -> lines.ParsedLine:
        parses[number] += 1
        return parse_line(number, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(lines, "parse_line", counted)
    monkeypatch.setattr(input_lines, "parse_line", counted)
    batch_stack.start_worker(step_seconds=0.01)
    batch_id = batch_stack.create(uploaded["id"])["id"]
    done, most = batch_stack.bg.run(
        _advance(batch_stack, batch_id, 60, in_flight=LINES), timeout=90
    )
    assert done and most <= LINES
    final = batch_stack.http.get(f"/v1/batches/{batch_id}").json()
    assert final["request_counts"] == {"total": LINES + 2, "completed": LINES, "failed": 2}
    output = batch_stack.content(final["output_file_id"])
    assert sorted(r["custom_id"] for r in output) == sorted(prompts)
    assert parses == Counter(range(1, LINES + len(BAD_AT) + 1))
