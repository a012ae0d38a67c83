"""`redis_io.memory_check`: which maxmemory settings are safe for a queue."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from redis_io.memory_check import redis_memory_warning, warn_about_redis_memory

MB = 1024 * 1024


def test_a_cap_with_noeviction_is_safe():
    assert redis_memory_warning({"maxmemory": 512 * MB, "maxmemory_policy": "noeviction"}) is None


def test_no_cap_is_unsafe_whatever_the_policy():
    warning = redis_memory_warning({"maxmemory": 0, "maxmemory_policy": "noeviction"})
    assert warning is not None and "no maxmemory" in warning and "README" in warning
    assert "maxmemory-policy" not in warning
    evicting = redis_memory_warning({"maxmemory": "0", "maxmemory_policy": "allkeys-lru"})
    assert evicting is not None and "maxmemory-policy noeviction" in evicting


@pytest.mark.parametrize(
    ("policy", "what"),
    [
        ("allkeys-lru", "queued jobs"),
        ("allkeys-lfu", "queued jobs"),
        ("allkeys-random", "queued jobs"),
        ("volatile-lru", "heartbeats"),
        ("volatile-lfu", "heartbeats"),
        ("volatile-random", "heartbeats"),
        ("volatile-ttl", "heartbeats"),
    ],
)
def test_every_evicting_policy_is_unsafe(policy, what):
    warning = redis_memory_warning({"maxmemory": 512 * MB, "maxmemory_policy": policy})
    assert warning is not None
    assert policy in warning and what in warning and "noeviction" in warning
    assert "\n" not in warning  # one log line


def test_a_nearly_full_redis_is_worth_a_warning():
    info = {"maxmemory": 100 * MB, "maxmemory_policy": "noeviction", "used_memory": 95 * MB}
    warning = redis_memory_warning(info)
    assert warning is not None and "95%" in warning and "raise maxmemory" in warning
    assert redis_memory_warning({**info, "used_memory": 50 * MB}) is None


@pytest.mark.anyio
async def test_the_check_hands_an_unsafe_setting_to_the_callers_logger(redis_server):
    unsafe: list[str] = []
    unchecked: list[Exception] = []
    redis = Redis.from_url(redis_server.url)
    try:
        await redis.config_set("maxmemory", "64mb")
        await redis.config_set("maxmemory-policy", "allkeys-lru")
        await warn_about_redis_memory(
            redis, on_unsafe=unsafe.append, on_unchecked=unchecked.append, timeout_s=5.0
        )
    finally:
        await redis.aclose()
    assert len(unsafe) == 1 and "allkeys-lru" in unsafe[0] and not unchecked


@pytest.mark.anyio
async def test_a_redis_that_does_not_answer_is_reported_unchecked_not_raised():
    unsafe: list[str] = []
    unchecked: list[Exception] = []
    redis = Redis.from_url("redis://127.0.0.1:1/0")  # nothing listens there
    try:
        await warn_about_redis_memory(
            redis, on_unsafe=unsafe.append, on_unchecked=unchecked.append, timeout_s=2.0
        )
    finally:
        await redis.aclose()
    assert len(unchecked) == 1 and not unsafe
