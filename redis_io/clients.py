"""The one way every inferq process gets a Redis client: from `RedisConnectionSettings`, a
plain URL or the master a set of Sentinels names.

A Sentinel client follows failovers by itself: its pool asks the Sentinels for the master's
address on every new connection, drops the connections to a master that moved, and turns the
READONLY answer of a demoted master into a ConnectionError. While no master is known each
command raises ConnectionError (MasterNotFoundError): the API answers it with 503 and
Retry-After, the worker's loop treats it as Redis being away (backoff, then carry on)."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from schemas.redis_connection import RedisConnectionSettings

# A connection to a master that died without closing its socket must not hang a request.
CONNECT_TIMEOUT_S = 5.0
# How long one Sentinel may take to answer "who is the master?" before the next one is asked.
SENTINEL_TIMEOUT_S = 1.0


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


def master_address(client: Redis) -> tuple[str, int] | None:
    """The master a Sentinel client last connected to (None for a plain client, or before its
    first connection): a change means a failover happened, even one no command noticed."""
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool) and pool.master_address is not None:
        host, port = pool.master_address
        return str(host), int(port)
    return None
