"""Open event streams while Redis goes away and comes back: each stream ends with an error event
the client can act on, the API logs one line per stream (no traceback), and a client that
reconnects with Last-Event-ID gets every chunk exactly once."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from redis.asyncio import Redis

from producer_api.client import Client
from producer_api.client.http_client import SseParser
from schemas import ErrorCode, TokenChunk
from tests.api.conftest import ALICE_KEY, KEYS, MODEL, BackgroundLoop, Stack, auth
from tests.api.fake_worker import Claimed, FakeWorker
from tests.conftest import RedisServer

WORDS = [f"w{i}" for i in range(8)]
BEFORE_OUTAGE = 3  # chunks published before Redis goes away


class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        return [self.format(r) for r in self.records if r.exc_info or r.stack_info]

    def warnings(self, text: str) -> list[str]:
        return [
            r.getMessage()
            for r in self.records
            if r.levelno >= logging.WARNING and text in r.getMessage()
        ]


@dataclass
class Puppet:
    """Plays the worker of one job step by step, so the test decides when Redis goes away."""

    stack: Stack
    worker: FakeWorker | None = None
    claimed: Claimed | None = None
    chunks: list[TokenChunk] = field(default_factory=list)

    def claim(self) -> None:
        async def claim() -> Claimed:
            self.worker = FakeWorker(
                Redis.from_url(self.stack.redis_url, decode_responses=True), KEYS, MODEL
            )
            await self.worker.create_group()
            for _ in range(50):
                claimed = await self.worker.claim(block_ms=100)
                if claimed is not None:
                    return claimed
            raise AssertionError("no job to claim")

        self.claimed = self.stack.bg.run(claim())
        job_id = self.claimed.job.id
        self.chunks = [
            TokenChunk(
                job_id=job_id,
                index=i,
                text=word if i == 0 else " " + word,
                token_ids=[i],
                finish_reason="stop" if i == len(WORDS) - 1 else None,
                final=i == len(WORDS) - 1,
            )
            for i, word in enumerate(WORDS)
        ]

    def publish(self, indices: range) -> None:
        assert self.worker is not None
        for i in indices:
            self.stack.bg.run(self.worker.publish([self.chunks[i]]))

    def finish(self) -> None:
        assert self.worker is not None and self.claimed is not None
        self.stack.bg.run(self.worker.finish(self.claimed, self.chunks))

    def close(self) -> None:
        if self.worker is not None:
            self.stack.bg.run(self.worker.redis.aclose())


@dataclass
class Outage:
    stack: Stack
    records: LogRecords
    puppet: Puppet

    @property
    def api_url(self) -> str:
        return self.stack.servers[0].url


@pytest.fixture
def outage(redis_server: RedisServer) -> Iterator[Outage]:
    """The API on a Redis the test may kill and restart, the puppet worker, and every log
    record of the process (uvicorn's own loggers do not propagate to the root logger, so both
    are watched)."""
    bg = BackgroundLoop()
    stack = Stack(redis_server.url, bg)
    records = LogRecords()
    watched = [logging.getLogger(), logging.getLogger("uvicorn")]
    puppet = Puppet(stack)
    try:
        stack.api()
        for logger in watched:
            logger.addHandler(records)
        yield Outage(stack, records, puppet)
    finally:
        for logger in watched:
            logger.removeHandler(records)
        if not redis_server.running:
            redis_server.start()
        puppet.close()
        stack.close()
        bg.close()


def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "condition not met in time"
        time.sleep(0.01)


def _run_through_an_outage(
    puppet: Puppet, redis_server: RedisServer, received: Callable[[], int]
) -> None:
    """The job's first chunks, then (once the reader has them) a Redis restart, then the rest
    of the chunks and the result."""
    puppet.publish(range(BEFORE_OUTAGE))
    _until(lambda: received() >= BEFORE_OUTAGE)
    redis_server.kill()
    time.sleep(0.5)  # streams notice, clients try to reconnect and are refused
    redis_server.start()
    puppet.publish(range(BEFORE_OUTAGE, len(WORDS)))
    puppet.finish()


def test_project_client_resumes_a_stream_across_a_redis_restart(outage, redis_server):
    puppet = outage.puppet
    received: list[TokenChunk] = []
    failure: list[BaseException] = []
    with Client(outage.api_url, api_key=ALICE_KEY) as client:
        job = client.enqueue(model=MODEL, prompt="resume me", stream=True)
        puppet.claim()

        def read() -> None:
            try:
                received.extend(client.stream(job.id))
            except BaseException as exc:  # reported by the assertion below
                failure.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            _run_through_an_outage(puppet, redis_server, lambda: len(received) + len(failure))
        finally:
            reader.join(20)
    assert not failure, failure
    assert [c.index for c in received] == list(range(len(WORDS)))
    assert "".join(c.text for c in received) == " ".join(WORDS)
    assert outage.records.tracebacks() == []
    assert len(outage.records.warnings("mid-stream")) == 1


def test_raw_sse_gets_an_error_event_and_resumes_with_last_event_id(outage, redis_server):
    seen: list[int] = []
    errors: list[dict] = []
    refused: list[int] = []
    done = threading.Event()

    def read(job_id: str) -> None:
        with httpx.Client(base_url=outage.api_url, headers=auth(), timeout=10) as http:
            while not done.is_set():
                headers = {"Last-Event-ID": str(seen[-1])} if seen else {}
                with http.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers) as response:
                    if response.status_code != 200:
                        refused.append(response.status_code)
                        time.sleep(0.1)
                        continue
                    parser = SseParser()
                    for line in response.iter_lines():
                        event = parser.feed(line)
                        if event is None:
                            continue
                        if event.event == "chunk":
                            assert event.id == str(json.loads(event.data)["index"])
                            seen.append(int(event.id))
                        elif event.event == "error":
                            errors.append(json.loads(event.data))
                        elif event.event == "done":
                            done.set()

    with httpx.Client(base_url=outage.api_url, headers=auth()) as http:
        created = http.post("/v1/jobs", json={"model": MODEL, "prompt": "raw", "stream": True})
    outage.puppet.claim()
    reader = threading.Thread(target=read, args=(created.json()["id"],), daemon=True)
    reader.start()
    _run_through_an_outage(outage.puppet, redis_server, lambda: len(seen))
    reader.join(20)
    assert done.is_set()
    assert seen == list(range(len(WORDS)))
    assert [e["code"] for e in errors] == [ErrorCode.UNAVAILABLE.value]
    assert "Last-Event-ID" in errors[0]["message"]
    assert set(refused) <= {503}
    assert outage.records.tracebacks() == []
    assert len(outage.records.warnings("mid-stream")) == 1


def test_openai_stream_ends_with_an_error_the_sdk_raises(outage, redis_server):
    texts: list[str] = []
    failure: list[BaseException] = []

    def read(sdk: openai.OpenAI) -> None:
        try:
            for chunk in sdk.completions.create(model=MODEL, prompt="sdk", stream=True):
                texts.append(chunk.choices[0].text)
        except BaseException as exc:
            failure.append(exc)

    outage.stack.heartbeat()  # the OpenAI routes serve models that a live worker advertises
    with openai.OpenAI(base_url=outage.api_url + "/v1", api_key=ALICE_KEY, max_retries=0) as sdk:
        reader = threading.Thread(target=read, args=(sdk,), daemon=True)
        reader.start()
        outage.puppet.claim()
        outage.puppet.publish(range(BEFORE_OUTAGE))
        _until(lambda: len(texts) == BEFORE_OUTAGE)
        redis_server.kill()
        reader.join(20)
    assert len(failure) == 1 and isinstance(failure[0], openai.APIError), failure
    assert failure[0].code == ErrorCode.UNAVAILABLE.value
    assert outage.records.tracebacks() == []
    assert len(outage.records.warnings("mid-stream")) == 1
