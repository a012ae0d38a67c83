"""Subscribing, the same way on one Redis and on a cluster (whose redis-py asyncio client has
no pub/sub of its own).

- Broadcast channels (the control channel, a model's arrivals): SUBSCRIBE. A cluster passes a
  PUBLISH to every node, so a subscription to any one node hears them all; a new subscription
  picks a node again, so one that died is left behind.
- Job channels: with `RedisKeys.cluster`, sharded pub/sub (SSUBSCRIBE on the node serving the
  channel's slot, which the job's keys share; the worker SPUBLISHes there), so a chunk costs
  only its own shard. The messages look as SUBSCRIBE's do (`type` "subscribe" / "message").
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import SlotNotCoveredError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import str_if_bytes

# sharded pub/sub replies, named as their plain twins so callers read them alike
_AS_PLAIN = {"ssubscribe": "subscribe", "smessage": "message", "sunsubscribe": "unsubscribe"}


_LOST = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError)


class _NodePubSub(PubSub):
    """A PubSub on a pool of its own (one cluster node); closing it closes the pool. When the
    node does not answer, the cluster client's slot map is reloaded before the error goes on,
    so the caller's next subscription finds the node that serves the slot now (a replica that
    took over)."""

    def __init__(self, cluster: RedisCluster, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cluster = cluster

    async def _node_lost(self) -> None:
        with contextlib.suppress(Exception):  # no node reachable yet: the next try reloads
            await self.cluster.nodes_manager.initialize()

    async def execute_command(self, *args: Any) -> None:
        try:
            await super().execute_command(*args)
        except _LOST:
            await self._node_lost()
            raise

    async def get_message(
        self, ignore_subscribe_messages: bool = False, timeout: float | None = 0.0
    ) -> dict[str, Any] | None:
        try:
            message: dict[str, Any] | None = await super().get_message(
                ignore_subscribe_messages, timeout
            )
        except _LOST:
            await self._node_lost()
            raise
        return message

    async def aclose(self) -> None:
        try:
            await super().aclose()  # type: ignore[no-untyped-call]
        finally:
            await self.connection_pool.disconnect()


class ShardedPubSub(_NodePubSub):
    """`subscribe` sends SSUBSCRIBE (and again on a reconnect); replies read as plain ones."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shard_channels: list[str] = []

    @property
    def subscribed(self) -> bool:
        return bool(self.shard_channels) or bool(self.channels or self.patterns)

    async def subscribe(self, *channels: Any, **handlers: Any) -> None:
        names = [str_if_bytes(c) for c in (*channels, *handlers)]
        self.shard_channels += names
        await self.execute_command("SSUBSCRIBE", *names)

    async def on_connect(self, connection: Any) -> None:
        if self.shard_channels:
            await self.execute_command("SSUBSCRIBE", *self.shard_channels)

    async def handle_message(
        self, response: Any, ignore_subscribe_messages: bool = False
    ) -> dict[str, Any] | None:
        if isinstance(response, list) and response:
            kind = str_if_bytes(response[0])
            if kind in _AS_PLAIN:
                plain = _AS_PLAIN[kind]
                head = plain.encode() if isinstance(response[0], bytes) else plain
                response = [head, *response[1:]]
        message: dict[str, Any] | None = await super().handle_message(  # type: ignore[no-untyped-call]
            response, ignore_subscribe_messages
        )
        return message


def _node_pool(node: ClusterNode | None) -> ConnectionPool:
    """A pool of plain connections to `node`, with the cluster client's connection options."""
    if node is None:
        raise SlotNotCoveredError("no cluster node serves that channel now")
    return ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)


async def broadcast_pubsub(redis: Redis, **options: Any) -> PubSub:
    """A PubSub for broadcast channels (SUBSCRIBE), on a cluster on one node picked at random."""
    if not isinstance(redis, RedisCluster):
        return redis.pubsub(**options)
    cluster: RedisCluster = redis
    await cluster.initialize()
    return _NodePubSub(cluster, _node_pool(random.choice(cluster.get_nodes())), **options)


async def job_pubsub(redis: Redis, channel: str, **options: Any) -> PubSub:
    """A PubSub whose `subscribe(channel)` hears the job channel `channel`: plain SUBSCRIBE on
    one Redis; on a cluster SSUBSCRIBE on the primary serving the channel's slot now."""
    if not isinstance(redis, RedisCluster):
        return redis.pubsub(**options)
    cluster: RedisCluster = redis
    await cluster.initialize()
    return ShardedPubSub(cluster, _node_pool(cluster.get_node_from_key(channel)), **options)
