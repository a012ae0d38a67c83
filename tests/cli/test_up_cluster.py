"""`inferq up --redis-cluster-primaries N` (cli.up_cluster): a local Redis Cluster on the ports
after --redis-url's, which every process is then pointed at."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
from redis import Redis
from redis.cluster import RedisCluster

from cli import up, up_system
from cli.up_cluster import start_redis_cluster


def _free_pair_base() -> int:
    """A port p with p+1..p+6 and their bus ports free."""
    for base in range(21000, 40000, 97):
        ports = range(base + 1, base + 7)
        if all(
            up_system.port_free("127.0.0.1", p) and up_system.port_free("127.0.0.1", p + 10000)
            for p in ports
        ):
            return base
    raise RuntimeError("no free ports")


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli not installed")
def test_a_cluster_of_three_primaries_starts_and_every_process_is_pointed_at_it(tmp_path: Path):
    base = _free_pair_base()
    url = f"redis://127.0.0.1:{base}/0"
    system = up_system.System()
    try:
        node_url = start_redis_cluster(system, 3, url, tmp_path)
        assert node_url == f"redis://127.0.0.1:{base + 1}/0"
        assert len(system.children) == 6
        client = RedisCluster.from_url(node_url)
        try:
            assert len(client.get_primaries()) == 3
            nodes = Redis(port=base + 1).cluster("nodes")  # replicas join the map as they sync
            assert len(nodes) == 6
            client.set("k", "v")
            assert client.get("k") == b"v"
        finally:
            client.close()
        # found running: nothing more is started
        assert start_redis_cluster(up_system.System(), 3, url, tmp_path) == node_url
        settings = up.UpSettings(redis_url=url, redis_cluster_primaries=3)
        env, _ = up.api_environment(settings, node_url)
        assert env["INFERQ_REDIS_URL"] == node_url and env["INFERQ_REDIS_CLUSTER"] == "true"
        assert env["INFERQ_REDIS_BATCH_QUEUE_URL"] == url
    finally:
        system.stop()
    with socket.socket() as sock:  # the nodes are gone
        assert sock.connect_ex(("127.0.0.1", base + 1)) != 0


def test_fewer_than_three_primaries_is_refused():
    with pytest.raises(up_system.UpError, match="at least 3"):
        start_redis_cluster(up_system.System(), 2, "redis://127.0.0.1:7000/0", Path("/nonexistent"))
