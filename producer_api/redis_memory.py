"""The API's start-up look at Redis's memory settings (see schemas.redis_memory)."""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas.redis_memory import redis_memory_warning

log = logging.getLogger(__name__)

# Start-up must not wait on a Redis that is not there yet: the check is advice, not a gate.
CHECK_TIMEOUT_S = 2.0


async def warn_about_redis_memory(redis: Redis) -> None:
    """One WARNING line when Redis may drop jobs' keys or grow without bound."""
    try:
        info = await asyncio.wait_for(redis.info("memory"), CHECK_TIMEOUT_S)
    except (RedisError, OSError) as exc:  # not up yet, or an ACL user without INFO
        log.info("could not check Redis's maxmemory settings: %s", exc)
        return
    warning = redis_memory_warning(info)
    if warning is not None:
        log.warning(warning)
