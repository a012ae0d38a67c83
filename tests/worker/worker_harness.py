"""Helpers for worker tests: an in-process worker on the test's event loop, a worker
subprocess, and readers of what a worker wrote to Redis."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from producer_api.client.redis_client import AsyncRedisClient
from schemas import Job, RedisKeys, TokenChunk, parse_channel_message
from schemas.chunks import REPLAY_FIELD
from worker.settings import WorkerSettings
from worker.worker import Worker

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
KEYS = RedisKeys()

# Fast reactions for tests: short blocking reads, frequent checks, short leases.
FAST = dict(
    block_ms=50,
    heartbeat_interval_s=0.2,
    status_check_interval_s=0.2,
    claim_min_idle_ms=1500,
    reconnect_min_s=0.05,
    reconnect_max_s=0.5,
    socket_timeout_s=5.0,
    # a chunk per step, published whether anyone listens or not: these tests check per-token
    # numbering (test_worker_relay.py runs the coalescing defaults)
    chunk_tokens=1,
    chunk_interval_ms=0,
    chunk_unwatched_ms=0,
)


def settings_for(redis_url: str, **overrides: Any) -> WorkerSettings:
    values = {**FAST, "name": f"w-{secrets.token_hex(3)}", "redis_url": redis_url, **overrides}
    return WorkerSettings(**values)


@asynccontextmanager
async def running_worker(
    redis_url: str, engine: Any, *, drain_timeout_s: float = 0.0, **overrides: Any
) -> AsyncIterator[Worker]:
    """A Worker running on this event loop; stopped (and its jobs handed back) on exit."""
    worker = Worker(settings_for(redis_url, **overrides), engine)
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.request_stop(drain_timeout_s)
        await asyncio.wait_for(task, 60)


def start_worker_process(
    redis_url: str, *, fake: bool, extra_env: dict[str, str] | None = None, **settings: Any
) -> subprocess.Popen[bytes]:
    """`inferq worker` as a child process; with `fake`, it runs tests/worker's FakeEngine."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")])
    values = {**FAST, "redis_url": redis_url, **settings}
    if fake:
        values["engine_factory"] = "worker_fakes:build_engine"
    else:
        # As the offline references (the smollm fixtures): dtype auto may pick bf16, whose
        # rounding depends on the batch, and tests compare tokens across batches and crashes.
        values.setdefault("dtype", "float32")
    for name, value in values.items():
        env[f"INFERQ_{name.upper()}"] = str(value)
    env.update(extra_env or {})
    # Output goes to a file, not a pipe: nobody reads the pipe while the test runs, and a worker
    # blocked on a full pipe buffer (64 KiB of log lines) would stall mid-test.
    with tempfile.NamedTemporaryFile(prefix="inferq-worker-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "cli", "--log-level", "info", "worker"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    process.log_path = Path(log.name)  # type: ignore[attr-defined]  # read it when debugging
    return process


def start_slow_fake_worker(
    redis_url: str,
    model: str,
    name: str,
    *,
    step_seconds: float = 0.05,
    env: dict[str, str] | None = None,
    **settings: Any,
) -> subprocess.Popen[bytes]:
    """A FakeEngine worker process at 50 ms a step: slow enough to stop mid-generation. `env`:
    more environment (the fake engine's INFERQ_FAKE_* variables)."""
    extra_env = {"INFERQ_FAKE_STEP_SECONDS": str(step_seconds), **(env or {})}
    return start_worker_process(
        redis_url, fake=True, model=model, name=name, extra_env=extra_env, **settings
    )


def stop_process(
    process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 60
) -> int:
    if process.poll() is None:
        process.send_signal(sig)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


async def replay_chunks(redis: Redis, job_id: str) -> list[tuple[str, TokenChunk]]:
    entries = await redis.xrange(KEYS.out_stream(job_id), "-", "+")
    out = []
    for entry_id, fields in entries:
        raw = fields.get(REPLAY_FIELD, fields.get(REPLAY_FIELD.encode()))
        out.append((_text(entry_id), TokenChunk.from_json(raw)))
    return out


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def wait_for(predicate: Any, timeout: float = 30.0, interval: float = 0.02) -> None:
    """Poll an (async or sync) predicate until it is truthy."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if loop.time() >= give_up:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


class LiveTap:
    """Every message published on any job channel, duplicates included (a raw subscriber)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.chunks: dict[str, list[TokenChunk]] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LiveTap:
        self.pubsub = self.redis.pubsub()
        await self.pubsub.psubscribe(KEYS.channel("") + "*")
        self._task = asyncio.create_task(self._listen())
        return self

    async def _listen(self) -> None:
        while True:
            message = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is None:
                continue
            parsed = parse_channel_message(message["data"])
            if isinstance(parsed, TokenChunk):
                self.chunks.setdefault(parsed.job_id, []).append(parsed)

    async def __aexit__(self, *exc_info: object) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.pubsub.aclose()


async def enqueue_token_jobs(
    client: AsyncRedisClient, model: str, count: int, max_tokens: int, first_token: int
) -> list[Job]:
    """`count` streaming jobs of three-token prompts, each prompt distinct."""
    return [
        await client.enqueue(
            model=model,
            prompt_token_ids=[first_token + i, first_token + 1, first_token + 2],
            stream=True,
            sampling={"max_tokens": max_tokens},
        )
        for i in range(count)
    ]


async def all_have_chunks(redis: Redis, jobs: list[Job], count: int) -> bool:
    return min([await redis.xlen(KEYS.out_stream(job.id)) for job in jobs]) >= count


async def stream_all(client: AsyncRedisClient, job_id: str) -> list[TokenChunk]:
    return [chunk async for chunk in client.stream(job_id)]


async def check_delivery(
    redis: Redis,
    job: Job,
    streamed: list[TokenChunk],
    live: list[TokenChunk] | None,
    expected: tuple[list[int], str],
) -> None:
    """The streaming client saw 0..k once each; the replay stream holds exactly those; any chunk
    number published twice live carried the same content; the text is the uninterrupted one.
    `live`: what a LiveTap heard for the job (None: no tap)."""
    ids, text = expected
    assert [c.index for c in streamed] == list(range(len(streamed)))
    assert "".join(c.text for c in streamed) == text
    assert [t for c in streamed for t in c.token_ids] == ids
    assert streamed[-1].final and not any(c.final for c in streamed[:-1])
    assert [c for _, c in await replay_chunks(redis, job.id)] == streamed
    if live is not None:
        assert live, "the live tap heard nothing"
        for chunk in live:
            assert chunk == streamed[chunk.index]
    assert job.result.choices[0].text == text and job.result.choices[0].token_ids == ids
