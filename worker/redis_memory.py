"""The worker's start-up look at Redis's memory settings (see schemas.redis_memory)."""

from __future__ import annotations

import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas.redis_memory import redis_memory_warning
from worker.logs import log_event

logger = logging.getLogger(__name__)


async def warn_about_redis_memory(redis: Redis) -> None:
    """Log `redis_memory_unsafe` (WARNING) when Redis may drop jobs' keys or grow without
    bound; an ACL user without INFO (`-@dangerous`) only gets an INFO line saying so."""
    try:
        info = await redis.info("memory")
    except (RedisError, OSError) as exc:
        log_event(logger, logging.INFO, "redis_memory_unchecked", error=exc)
        return
    warning = redis_memory_warning(info)
    if warning is not None:
        log_event(logger, logging.WARNING, "redis_memory_unsafe", problem=warning)
