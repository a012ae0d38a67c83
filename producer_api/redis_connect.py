"""The one way the API, the batch controller, the Python client and the CLI get a Redis client:
from `RedisConnectionSettings`, a plain URL or the master a set of Sentinels names.

A Sentinel client follows failovers by itself: its pool asks the Sentinels for the master's
address on every new connection, drops the connections to a master that moved, and turns the
READONLY answer of a demoted master into a ConnectionError. While no master is known each
command raises ConnectionError (MasterNotFoundError), which the API answers with 503 and
Retry-After. (`worker.redis_connect` is this module's twin on the worker side.)"""

from __future__ import annotations

import logging

from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel

from schemas.redis_connection import SENTINEL_TIMEOUT_S, RedisConnectionSettings, ReplicaWait

log = logging.getLogger(__name__)

# A connection to a master that died without closing its socket must not hang a request.
CONNECT_TIMEOUT_S = 5.0


def redis_client(
    settings: RedisConnectionSettings,
    *,
    decode_responses: bool = True,
    socket_timeout: float | None = None,
    socket_connect_timeout: float = CONNECT_TIMEOUT_S,
) -> Redis:
    """A client of the Redis `settings` name (the Sentinels' master when they are set)."""
    if not settings.uses_sentinel:
        client: Redis = Redis.from_url(
            settings.redis_url,
            decode_responses=decode_responses,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout,
        )
        return client
    login = settings.master_login()
    sentinel = Sentinel(
        settings.sentinel_addresses(),
        sentinel_kwargs={
            "socket_timeout": SENTINEL_TIMEOUT_S,
            "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        },
    )
    master: Redis = sentinel.master_for(
        settings.redis_master_name,
        db=login.db,
        username=login.username,
        password=login.password,
        decode_responses=decode_responses,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
    )
    return master


def replicated(reply: object, wait: ReplicaWait, what: str) -> bool:
    """Whether a WAIT `reply` reached `wait.replicas`; logs one line when it did not (the
    write stands on the master alone: a failover now could lose it)."""
    if isinstance(reply, Exception):
        log.warning("%s: WAIT for replicas failed: %s", what, reply)
        return False
    reached = reply if isinstance(reply, int) else 0
    if reached < wait.replicas:
        log.warning(
            "%s: only %d of %d replicas acknowledged within %d ms",
            what,
            reached,
            wait.replicas,
            wait.timeout_ms,
        )
        return False
    return True
