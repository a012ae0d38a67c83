"""The one way every inferq process gets a Redis client: from `RedisConnectionSettings`, a
plain URL, the master a set of Sentinels names, or (with `redis_cluster`) redis-py's cluster
client seeded by the URL's node.

The cluster client follows MOVED/ASK redirections and, when a node stops answering, reloads the
slot map and retries (`CLUSTER_ERROR_RETRIES`); it serves the same command API as the plain
client and is handed around typed as one. Where the two differ (pub/sub, MULTI) callers go
through `redis_io.pubsub` and `pipeline`.

A Sentinel client follows failovers by itself: its pool asks the Sentinels for the master's
address on every new connection, drops the connections to a master that moved, and turns the
READONLY answer of a demoted master into a ConnectionError. While no master is known each
command raises ConnectionError (MasterNotFoundError): the API answers it with 503 and
Retry-After, the worker's loop treats it as Redis being away (backoff, then carry on)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.exceptions import ClusterDownError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from schemas.redis_connection import RedisConnectionSettings

# A connection to a master that died without closing its socket must not hang a request.
CONNECT_TIMEOUT_S = 5.0
# How long one Sentinel may take to answer "who is the master?" before the next one is asked.
SENTINEL_TIMEOUT_S = 1.0
# How often the cluster client reloads the slot map and retries a command whose node failed: a
# replica takes over a dead primary after the cluster's node timeout (seconds), and a worker or
# API request treats what is left as Redis being away (backoff, 503).
CLUSTER_ERROR_RETRIES = 5
# What a cluster answers while a shard has no primary (a failover under way): Redis is away.
CLUSTER_AWAY = (ClusterDownError, TryAgainError, SlotNotCoveredError)


def redis_client(
    settings: RedisConnectionSettings,
    *,
    decode_responses: bool = True,
    socket_timeout: float | None = None,
    socket_connect_timeout: float = CONNECT_TIMEOUT_S,
) -> Redis:
    """A client of the Redis `settings` name (the Sentinels' master when they are set; the
    cluster's client, typed as a plain one, with `redis_cluster`)."""
    if settings.redis_cluster:
        cluster = RedisCluster.from_url(
            settings.redis_url,
            decode_responses=decode_responses,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout,
            cluster_error_retry_attempts=CLUSTER_ERROR_RETRIES,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
        )
        # Same command API; pub/sub and MULTI, which differ, go through this package.
        return cast(Redis, cluster)
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
    if is_cluster(client):
        return None  # a cluster client follows its shards' failovers itself
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool) and pool.master_address is not None:
        host, port = pool.master_address
        return str(host), int(port)
    return None


def is_cluster(redis: Redis) -> bool:
    """Whether `redis` is the cluster client `redis_client` gives with `redis_cluster`."""
    return isinstance(redis, RedisCluster)


def channels_by_shard(redis: Redis, channels: Iterable[str]) -> list[tuple[ClusterNode, list[str]]]:
    """Sharded channels grouped by the primary that serves each one's slot now (a cluster
    client's view; it follows MOVED on its own)."""
    cluster = cast(RedisCluster, redis)
    out: dict[str, tuple[ClusterNode, list[str]]] = {}
    for channel in channels:
        node = cluster.get_node_from_key(channel)
        if node is None:  # a slot map with a hole: the same error a command on that slot gets
            raise SlotNotCoveredError(f"no cluster node serves the slot of {channel!r}")
        out.setdefault(node.name, (node, []))[1].append(channel)
    return list(out.values())


def pipeline(redis: Redis, *, atomic: bool) -> Pipeline:
    """A pipeline; `atomic` (MULTI/EXEC) on a single node or Sentinel master. A cluster runs
    each node's share of it on that node, in order, but not as one transaction (MULTI cannot
    span shards): callers that need atomicity keep it to one job's keys and a script."""
    return redis.pipeline(transaction=atomic and not is_cluster(redis))


async def raise_for_cluster_outage(redis: Redis, replies: list[object]) -> None:
    """After `pipeline.execute(raise_on_error=False)`: on a cluster, a node that did not answer
    leaves its commands' replies as errors and the client's slot map as it was (redis-py reloads
    it only when an error is raised). Raise the first such error, with the map marked stale, so
    the caller treats it as Redis being away (re-sends once the replica has taken over). Other
    errors in `replies` are the caller's to read."""
    if not is_cluster(redis):
        return
    away = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, *CLUSTER_AWAY)
    lost = next((reply for reply in replies if isinstance(reply, away)), None)
    if lost is not None:
        await redis.aclose()  # the cluster client reloads its slot map on the next command
        raise lost
