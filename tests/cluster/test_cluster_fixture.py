"""The local cluster the cluster tests run on: 3 primaries, each with a replica that takes over
when its primary is SIGKILLed."""

from __future__ import annotations

import redis
from redis.cluster import RedisCluster


def test_three_primaries_with_replicas_serve_every_slot(redis_cluster):
    client = RedisCluster.from_url(redis_cluster.url, decode_responses=True)
    try:
        assert len(redis_cluster.primaries()) == 3
        for i in range(30):
            client.set(f"k{i}", i)
        assert [int(client.get(f"k{i}")) for i in range(30)] == list(range(30))
        # the keys spread over more than one primary
        assert len({redis_cluster.primary_of(f"k{i}").port for i in range(30)}) > 1
    finally:
        client.close()


def test_a_replica_takes_over_a_killed_primary(private_redis_cluster):
    cluster = private_redis_cluster
    client = RedisCluster.from_url(cluster.url, decode_responses=True)
    try:
        client.set("survivor", "yes")
        client.wait(1, 2000)  # the replica has it
        victim = cluster.primary_of("survivor")
        victim.kill()
        cluster.wait_ready()
        assert cluster.primary_of("survivor").port != victim.port
        assert redis.Redis(port=cluster.primary_of("survivor").port).get("survivor") == b"yes"
    finally:
        client.close()
