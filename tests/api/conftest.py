"""API test fixtures: a real uvicorn server and echo workers on a background event loop.

Both run on one private event-loop thread, so tests may use blocking clients (httpx.Client, the
official `openai` package) as well as async ones without starving the server."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvicorn
from redis.asyncio import Redis

from producer_api.app import create_app
from producer_api.settings import ApiSettings
from schemas import RedisKeys
from tests.api.echo_worker import EchoWorker

T = TypeVar("T")

MODEL = "echo-model"
ALICE_KEY = "sk-alice-test-key"
BOB_KEY = "sk-bob-test-key"
KEYS = RedisKeys()


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout)

    def start(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class ApiServer:
    settings: ApiSettings
    server: uvicorn.Server
    serving: Future[None]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Stack:
    """The API and its workers for one test."""

    redis_url: str
    bg: BackgroundLoop
    servers: list[ApiServer] = field(default_factory=list)
    workers: list[tuple[EchoWorker, asyncio.Event, Future[None], Redis]] = field(
        default_factory=list
    )

    def api(self, **overrides: Any) -> ApiServer:
        values: dict[str, Any] = {
            "redis_url": self.redis_url,
            "api_keys": {"alice": ALICE_KEY, "bob": BOB_KEY},
            "models": [MODEL],  # the jobs API queues for it even before a worker beats
            "poll_interval_s": 0.2,
            "worker_cache_s": 0.0,
            "sse_keepalive_s": 1.0,
        }
        values.update(overrides)
        settings = ApiSettings(**values)
        config = uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=0, log_level="warning", lifespan="on"
        )
        server = uvicorn.Server(config)
        serving = self.bg.start(server.serve())
        self.bg.run(_until(lambda: server.started or serving.done()))
        if serving.done():
            serving.result()  # raises the start-up error
        port = server.servers[0].sockets[0].getsockname()[1]
        api = ApiServer(settings, server, serving, port)
        self.servers.append(api)
        return api

    def worker(
        self,
        model: str = MODEL,
        *,
        max_model_len: int | None = None,
        step_delay_s: float = 0.0,
        name: str | None = None,
        tokenizer_file: Path | None = None,
        quantization: str | None = None,
        architecture: str | None = None,
        lora_adapters: list[str] | None = None,
    ) -> EchoWorker:
        async def make() -> tuple[EchoWorker, Redis]:
            redis = Redis.from_url(self.redis_url, decode_responses=True)
            worker = EchoWorker(
                redis,
                KEYS,
                model,
                name=name or f"echo-{len(self.workers) + 1}",
                max_model_len=max_model_len,
                step_delay_s=step_delay_s,
                tokenizer_file=tokenizer_file,
                quantization=quantization,
                architecture=architecture,
                lora_adapters=lora_adapters,
            )
            await worker.create_group()
            await worker.beat()
            return worker, redis

        worker, redis = self.bg.run(make())
        stop = self.bg.run(_event())
        running = self.bg.start(worker.run(stop))
        self.workers.append((worker, stop, running, redis))
        return worker

    def heartbeat(self, model: str = MODEL, name: str = "idle-worker") -> None:
        """A live worker's heartbeat for `model`, with no worker behind it (it takes nothing)."""

        async def beat() -> None:
            redis = Redis.from_url(self.redis_url, decode_responses=True)
            try:
                await EchoWorker(redis, KEYS, model, name=name).beat()
            finally:
                await redis.aclose()

        self.bg.run(beat())

    def stop_workers(self) -> None:
        for _worker, stop, running, redis in self.workers:
            self.bg.loop.call_soon_threadsafe(stop.set)
            running.result(10)
            self.bg.run(redis.aclose())
        self.workers.clear()

    def close(self) -> None:
        self.stop_workers()
        for api in self.servers:
            api.server.should_exit = True
            api.serving.result(15)
        self.servers.clear()


async def _event() -> asyncio.Event:
    return asyncio.Event()


async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while not condition():
        if loop.time() > give_up:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


@pytest.fixture
def stack(redis_url: str) -> Iterator[Stack]:
    bg = BackgroundLoop()
    built = Stack(redis_url, bg)
    try:
        yield built
    finally:
        built.close()
        bg.close()


def auth(key: str = ALICE_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
