"""Batch test fixtures: the API (uvicorn), an in-process arq batch controller and an
in-process inference worker on the fake engine, all on one background event loop."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

import httpx
import pytest
from arq.connections import RedisSettings
from arq.worker import Worker as ArqWorker
from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))  # worker_fakes

from worker_fakes import FakeEngine

from producer_api.batches import controller
from tests.api.conftest import ALICE_KEY, BackgroundLoop, Stack
from tests.batch.batch_calls import BatchCalls
from worker.settings import WorkerSettings
from worker.worker import Worker

FAKE_MODEL = "fake-model"
FAST_CONTROLLER_ENV = {
    "INFERQ_BATCH_POLL_INTERVAL_S": "0.1",
    "INFERQ_BATCH_LEASE_S": "2",
    "INFERQ_BATCH_TICK_S": "30",
    "INFERQ_BATCH_RESUME_EVERY_S": "1",
}


def arq_worker(redis_url: str) -> ArqWorker:
    """The controller as `arq producer_api.batches.controller.WorkerSettings` builds it."""
    settings = controller.WorkerSettings
    return ArqWorker(
        functions=settings.functions,
        cron_jobs=settings.cron_jobs,
        on_startup=settings.on_startup,
        on_shutdown=settings.on_shutdown,
        redis_settings=RedisSettings.from_dsn(redis_url),
        queue_name=settings.queue_name,
        max_tries=settings.max_tries,
        job_timeout=settings.job_timeout,
        poll_delay=0.05,
        handle_signals=False,
    )


class BatchStack(BatchCalls):
    def __init__(self, redis_url: str, bg: BackgroundLoop) -> None:
        self.redis_url = redis_url
        self.bg = bg
        self.stack = Stack(redis_url, bg)
        self.api = self.stack.api(models=[FAKE_MODEL])
        self.http = httpx.Client(
            base_url=self.api.url, headers={"Authorization": f"Bearer {ALICE_KEY}"}, timeout=30
        )
        self._arq: tuple[ArqWorker, Future[Any]] | None = None
        self._workers: list[tuple[Worker, Future[Any]]] = []

    def start_controller(self) -> None:
        async def make() -> ArqWorker:
            return arq_worker(self.redis_url)

        worker = self.bg.run(make())
        self._arq = (worker, self.bg.start(worker.async_run()))

    def start_worker(self, step_seconds: float = 0.002, **overrides: Any) -> Worker:
        async def make() -> Worker:
            settings = WorkerSettings(
                name=f"fw-{len(self._workers)}",
                redis_url=self.redis_url,
                served_model_name=FAKE_MODEL,
                block_ms=50,
                heartbeat_interval_s=0.2,
                status_check_interval_s=0.2,
                **overrides,
            )
            return Worker(settings, FakeEngine(step_seconds=step_seconds))

        worker = self.bg.run(make())
        self._workers.append((worker, self.bg.start(worker.run())))
        return worker

    def stop_workers(self) -> None:
        for worker, running in self._workers:
            self.bg.loop.call_soon_threadsafe(worker.request_stop, 0.0)
            running.result(30)
        self._workers.clear()

    def close(self) -> None:
        self.stop_workers()
        if self._arq is not None:
            worker, running = self._arq
            try:
                self.bg.run(worker.close())
            except CancelledError:
                # arq's close cancels a job still running (a resume tick) and re-raises that
                # cancellation before closing its pool: close the pool here instead.
                self.bg.run(worker.pool.close(close_connection_pool=True))
            running.cancel()
        self.http.close()
        self.stack.close()


@pytest.fixture
def controller_env(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> str:
    monkeypatch.setenv("INFERQ_REDIS_URL", redis_url)
    for name, value in FAST_CONTROLLER_ENV.items():
        monkeypatch.setenv(name, value)
    return redis_url


@pytest.fixture
def batch_stack(controller_env: str) -> Iterator[BatchStack]:
    bg = BackgroundLoop()
    stack = BatchStack(controller_env, bg)
    try:
        yield stack
    finally:
        stack.close()
        bg.close()


def run_async(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


@pytest.fixture
def redis(system) -> Iterator[Redis]:
    """A client of the module's real system (modules that run one define `system`)."""
    client = Redis.from_url(system.server.url, decode_responses=True)
    yield client
    client.close()
