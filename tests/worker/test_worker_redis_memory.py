"""A starting worker warns once when Redis could drop jobs' keys or grow without bound."""

from __future__ import annotations

import logging

import pytest
import redis as sync_redis
from worker_fakes import FakeEngine
from worker_harness import KEYS, running_worker, wait_for

pytestmark = pytest.mark.anyio


def configure(url: str, maxmemory: str, policy: str) -> None:
    with sync_redis.Redis.from_url(url) as client:
        client.config_set("maxmemory", maxmemory)
        client.config_set("maxmemory-policy", policy)


async def start_worker(url: str) -> None:
    """A worker started (until its first heartbeat) and stopped."""
    async with running_worker(url, FakeEngine(), model="fake-model", name="mem-w") as worker:
        await wait_for(lambda: worker.redis.exists(KEYS.worker("mem-w")))


@pytest.mark.parametrize(
    ("maxmemory", "policy", "expected"),
    [("0", "noeviction", "no maxmemory"), ("64mb", "volatile-lru", "volatile-lru")],
)
async def test_unsafe_settings_get_one_warning(redis_server, caplog, maxmemory, policy, expected):
    configure(redis_server.url, maxmemory, policy)
    with caplog.at_level(logging.INFO, "worker"):
        await start_worker(redis_server.url)
    unsafe = [r.getMessage() for r in caplog.records if "redis_memory_unsafe" in r.getMessage()]
    assert len(unsafe) == 1 and expected in unsafe[0]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.getMessage() in unsafe)


async def test_a_capped_noeviction_redis_gets_none(redis_server, caplog):
    configure(redis_server.url, "64mb", "noeviction")
    with caplog.at_level(logging.INFO, "worker"):
        await start_worker(redis_server.url)
    assert not [r for r in caplog.records if "redis_memory" in r.getMessage()]
