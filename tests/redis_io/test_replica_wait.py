"""`redis_io.replica_wait`: a WAIT that reached too few replicas (or failed) is said so, once."""

from __future__ import annotations

import logging

import pytest
from redis.asyncio import Redis

from redis_io.replica_wait import fell_short, replicated, wait_command
from schemas.redis_connection import ReplicaWait

pytestmark = pytest.mark.anyio
WAIT = ReplicaWait(replicas=1, timeout_ms=20)


async def test_a_wait_no_replica_answers_is_logged_as_short(redis_url, caplog):
    redis = Redis.from_url(redis_url)
    try:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.set("k", "v")
            pipe.execute_command(*wait_command(WAIT))
            _, reached = await pipe.execute()
    finally:
        await redis.aclose()
    assert reached == 0 and fell_short(reached, WAIT)
    with caplog.at_level(logging.WARNING, "redis_io"):
        assert not replicated(reached, WAIT, "job j")
    assert caplog.messages == ["job j: only 0 of 1 replicas acknowledged within 20 ms"]


def test_enough_replicas_pass_silently_and_a_failed_wait_falls_short(caplog):
    with caplog.at_level(logging.WARNING, "redis_io"):
        assert replicated(2, WAIT, "job j") and not fell_short(1, WAIT)
        assert caplog.messages == []
        assert not replicated(ConnectionError("gone"), WAIT, "job j")
    assert fell_short(ConnectionError("gone"), WAIT)
    assert caplog.messages == ["job j: WAIT for replicas failed: gone"]
