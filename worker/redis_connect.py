"""The worker's Redis clients, from `RedisConnectionSettings`: a plain URL, or the master a set
of Sentinels names (the twin of `producer_api.redis_connect`, which the worker may not import).

A Sentinel client follows failovers by itself: its pool asks the Sentinels for the master on
every new connection and turns a demoted master's READONLY into a ConnectionError, which the
worker's loop treats as Redis being away (backoff, then carry on; see worker.worker)."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from schemas.redis_connection import SENTINEL_TIMEOUT_S, RedisConnectionSettings


def redis_client(
    settings: RedisConnectionSettings,
    *,
    decode_responses: bool,
    socket_timeout: float,
    socket_connect_timeout: float,
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
