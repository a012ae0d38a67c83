"""`schemas.redis_memory`: which maxmemory settings are safe for a queue."""

from __future__ import annotations

import pytest

from schemas.redis_memory import redis_memory_warning

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
