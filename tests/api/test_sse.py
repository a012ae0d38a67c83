"""`producer_api.sse.ending_on_failure`: what a stream sends and logs when Redis goes away under
it, on the jobs stream and on the OpenAI routes (the end-to-end runs are in
test_stream_outage.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from producer_api.queue import QueueError
from producer_api.sse import ending_on_failure
from schemas import ErrorBody, ErrorCode

JOBS_PATH = "/v1/jobs/job_x/stream"
OPENAI_PATH = "/v1/chat/completions"


async def _failing(failure: Exception, cleanup: Exception | None = None) -> AsyncIterator[bytes]:
    try:
        yield b"data: first\n\n"
        raise failure
    finally:
        if cleanup is not None:
            raise cleanup


async def _collect(events: AsyncIterator[bytes]) -> list[bytes]:
    return [item async for item in events]


def _fields(event: bytes) -> dict[str, str]:
    lines = event.decode().strip().split("\n")
    return dict(line.split(": ", 1) for line in lines)


@pytest.mark.anyio
async def test_jobs_stream_ends_with_an_unavailable_event_and_a_retry_hint(caplog):
    events = ending_on_failure(_failing(RedisConnectionError("Connection closed")), JOBS_PATH)
    with caplog.at_level(logging.DEBUG, "producer_api.sse"):
        sent = await _collect(events)
    assert sent[0] == b"data: first\n\n"
    last = _fields(sent[1])
    assert last["event"] == "error" and int(last["retry"]) > 0
    body = ErrorBody.model_validate_json(last["data"])
    assert body.code is ErrorCode.UNAVAILABLE and "Last-Event-ID" in body.message
    assert len(sent) == 2
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert not caplog.records[0].exc_info


@pytest.mark.anyio
async def test_openai_stream_ends_with_openai_error_object(caplog):
    failing = _failing(RedisConnectionError("gone"), cleanup=RedisConnectionError("still gone"))
    with caplog.at_level(logging.DEBUG, "producer_api.sse"):
        sent = await _collect(ending_on_failure(failing, OPENAI_PATH))
    last = _fields(sent[-1])
    error = json.loads(last["data"])["error"]
    assert error["code"] == ErrorCode.UNAVAILABLE.value and error["type"] == "server_error"
    assert "retry" not in last  # an OpenAI stream cannot be resumed
    # the failed clean-up (cancelling the jobs) is what reached the wrapper: still one line
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


@pytest.mark.anyio
async def test_a_queue_error_keeps_its_own_body():
    error = ErrorBody.of(ErrorCode.UNAVAILABLE, "could not subscribe to inferq:chan:x")
    sent = await _collect(ending_on_failure(_failing(QueueError(error)), JOBS_PATH))
    assert ErrorBody.model_validate_json(_fields(sent[-1])["data"]) == error


@pytest.mark.anyio
async def test_closing_early_while_redis_is_away_logs_one_line(caplog):
    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b": tick\n\n"
        finally:
            raise RedisConnectionError("cannot cancel the jobs")

    events = ending_on_failure(endless(), OPENAI_PATH)
    with caplog.at_level(logging.DEBUG, "producer_api.sse"):
        assert await anext(events) == b": tick\n\n"
        await events.aclose()  # the client went away
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "clean-up failed" in caplog.records[0].getMessage()


@pytest.mark.anyio
async def test_other_errors_are_not_hidden():
    with pytest.raises(ZeroDivisionError):
        await _collect(ending_on_failure(_failing(ZeroDivisionError()), JOBS_PATH))
