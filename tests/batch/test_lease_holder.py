"""A restarted batch controller takes over a batch whose run's process died on this host at
once, without waiting out the lease; a live run, or one elsewhere, keeps its batch."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from redis.asyncio import Redis

from producer_api.batches.controller import resume_batches
from producer_api.batches.lease_holder import holder_known_dead, holder_token
from schemas import RedisKeys

pytestmark = pytest.mark.anyio
KEYS = RedisKeys()


def _token_of(pid: int) -> str:
    host, namespace, _, random = holder_token().split("/")
    return f"{host}/{namespace}/{pid}/{random}"


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_an_exited_process_of_this_host_counts_as_dead():
    assert holder_known_dead(_token_of(_exited_pid()))
    assert not holder_known_dead(holder_token())  # this very process
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not holder_known_dead(_token_of(sleeper.pid))
    finally:
        sleeper.kill()
        sleeper.wait()
    _, namespace, pid, random = _token_of(_exited_pid()).split("/")
    assert not holder_known_dead(f"another-host/{namespace}/{pid}/{random}")
    assert not holder_known_dead("0123456789abcdef")  # a token of the old form


class _Arq:
    def __init__(self) -> None:
        self.enqueued: list[tuple[Any, ...]] = []

    async def enqueue_job(self, *args: Any, **kwargs: Any) -> None:
        self.enqueued.append(args)


async def test_resume_takes_over_a_dead_runs_lease_and_leaves_a_live_ones(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    await redis.sadd(KEYS.active_batches(), "batch_dead", "batch_live")
    await redis.set(KEYS.batch_lease("batch_dead"), _token_of(_exited_pid()), px=60_000)
    await redis.set(KEYS.batch_lease("batch_live"), holder_token(), px=60_000)
    arq = _Arq()
    resumed = await resume_batches({"inferq_redis": redis, "keys": KEYS, "redis": arq})
    assert resumed == 1
    assert [args[1] for args in arq.enqueued] == ["batch_dead"]
    assert not await redis.exists(KEYS.batch_lease("batch_dead"))
    assert await redis.exists(KEYS.batch_lease("batch_live"))
    await redis.aclose()
