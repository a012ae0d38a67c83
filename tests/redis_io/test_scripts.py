"""`redis_io.scripts`: a script runs by its SHA1, and a Redis that forgot it (a restart, a new
master) gets its text once, then knows it again."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from redis_io.scripts import run_script, script_sha

pytestmark = pytest.mark.anyio

ECHO = "return {KEYS[1], ARGV[1], #ARGV}"


async def test_a_script_redis_forgot_is_loaded_once_then_run_by_sha(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    try:
        await redis.script_flush()
        assert await redis.script_exists(script_sha(ECHO)) == [False]
        assert await run_script(redis, ECHO, ["k"], ["a", 2]) == ["k", "a", 2]
        assert await redis.script_exists(script_sha(ECHO)) == [True]
        await redis.config_resetstat()
        assert await run_script(redis, ECHO, ["k2"], [3]) == ["k2", "3", 1]
        stats = await redis.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 1 and "cmdstat_eval" not in stats
    finally:
        await redis.aclose()
