"""On a Redis Cluster, the shards a worker reads first: its home shards.

Every round trip a worker makes reaches each shard that holds one of the jobs it writes for,
and a shard pays per round trip as much as for the commands in it. Each partition's jobs live
on the partition's shard (schemas.cluster_slots), so a worker that takes its jobs from one
shard's partitions writes to that shard alone, and each shard hears from its own share of the
workers instead of from all of them.

The model's live workers (the sorted set `RedisKeys.model_workers`, which each one refreshes
with its heartbeat) split the shards that hold the model's partitions between them by their
names' order: with W workers and S shards, worker i's home is shard i mod S when W >= S (a
shard has W/S home workers, give or take one), and shards i, i + W, ... otherwise (every shard
has one). A worker reads its home partitions first and the others only with the room they
leave, so no partition waits for a worker of its own, and none is left unread."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import SlotNotCoveredError

from redis_io.clients import is_cluster
from schemas import RedisKeys
from schemas.jobs import as_text


class ShardHomes:
    """Which of a model's partition streams (by index) are on this worker's home shards."""

    def __init__(self, redis: Redis, keys: RedisKeys, model: str, name: str) -> None:
        self.redis = redis
        self.keys = keys
        self.model = model
        self.name = name
        self.workers: list[str] = []  # the model's live workers, sorted

    async def beat(self, ttl_s: float) -> None:
        """Say this worker is alive, and learn who else is (one round trip)."""
        key = self.keys.model_workers(self.model)
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {self.name: now})
            pipe.zremrangebyscore(key, "-inf", f"({now - ttl_s}")
            pipe.expire(key, max(1, int(ttl_s)))
            pipe.zrange(key, 0, -1)
            replies = await pipe.execute()
        self.workers = sorted(as_text(name) for name in replies[-1])

    async def leave(self) -> None:
        await self.redis.zrem(self.keys.model_workers(self.model), self.name)

    def home(self, streams: Sequence[str]) -> set[int]:
        """The indexes of `streams` that are on this worker's home shards (empty: no homes
        known, as before the first heartbeat, or the cluster's slot map is not loaded)."""
        if self.name not in self.workers or not is_cluster(self.redis):
            return set()
        cluster = cast(RedisCluster, self.redis)
        nodes = []
        for stream in streams:
            try:
                node = cluster.get_node_from_key(stream)
            except SlotNotCoveredError:  # no map yet, or a shard without a primary
                return set()
            if node is None:
                return set()
            nodes.append(node.name)
        shards = sorted(set(nodes))
        homes = home_shards(self.workers.index(self.name), len(self.workers), len(shards))
        return {k for k, node in enumerate(nodes) if shards.index(node) in homes}


def home_shards(index: int, workers: int, shards: int) -> set[int]:
    """Worker `index` of `workers`: the shards (of `shards`) it reads first."""
    if workers >= shards:
        return {index % shards}
    return set(range(index, shards, workers))
