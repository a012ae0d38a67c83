"""The shared state of a producer process (the HTTP app, the gRPC server): its Redis client,
key names, API keys, live-worker directory and tokenizers, opened and closed in one place."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.asyncio import Redis

from producer_api.deps import ApiState
from producer_api.metrics import ApiMetrics
from producer_api.prompt_tokens import TokenizerCache
from producer_api.settings import ApiSettings
from producer_api.workers import WorkerDirectory
from redis_io.clients import redis_client
from redis_io.memory_check import warn_about_redis_memory

log = logging.getLogger(__name__)

# Start-up must not wait on a Redis that is not there yet: the memory check is advice, not a gate.
MEMORY_CHECK_TIMEOUT_S = 2.0


def connect_redis(settings: ApiSettings) -> Redis:
    """The one way a producer process makes its Redis client (a connection pool): the URL's
    server, or the master the Sentinels name (see redis_io.clients)."""
    return redis_client(settings)


@asynccontextmanager
async def open_state(settings: ApiSettings, metrics: ApiMetrics) -> AsyncIterator[ApiState]:
    """The process's state; its Redis connections are closed on exit."""
    redis = connect_redis(settings)
    keys = settings.redis_keys(settings.prefix)
    state = ApiState(
        settings=settings,
        redis=redis,
        keys=keys,
        key_table=settings.key_table(),
        workers=WorkerDirectory(redis, keys, settings.worker_cache_s),
        metrics=metrics,
        tokenizers=TokenizerCache(),
    )
    await warn_about_redis_memory(
        redis,
        on_unsafe=log.warning,
        on_unchecked=lambda exc: log.info("could not check Redis's maxmemory settings: %s", exc),
        timeout_s=MEMORY_CHECK_TIMEOUT_S,
    )
    if settings.auth_disabled:
        log.warning(
            "AUTHENTICATION IS DISABLED: anyone who can reach this port can use the API "
            "(INFERQ_AUTH_DISABLED); use it on localhost only"
        )
    try:
        yield state
    finally:
        await redis.aclose()
