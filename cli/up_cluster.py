"""`inferq up --redis-cluster N`: a local Redis Cluster of N primaries with a replica each,
for trying cluster mode on one machine. Its nodes listen on the 2N ports after --redis-url's
(whose own server stays, as the batch controller's queue: see `redis_batch_queue_url`), keep
their data and cluster config under --data-dir/cluster-<port>, and are joined once by
`redis-cli --cluster create`; started again on the same ports, the nodes find each other
from their saved config."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import redis

from cli.up_redis import redis_server_args
from cli.up_system import System, UpError, port_free

CLUSTER_READY_S = 60.0
NODE_TIMEOUT_MS = 5000


def cluster_ok(host: str, port: int) -> bool:
    """Whether the node on `port` answers and says every slot is served."""
    try:
        client = redis.Redis(host=host, port=port, socket_connect_timeout=1, socket_timeout=1)
        try:
            info = client.cluster("info")  # parsed into a dict of its fields
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False
    return isinstance(info, dict) and str(info.get("cluster_state")) == "ok"


def start_redis_cluster(
    system: System, primaries: int, url: str, data_dir: Path, replicas: int = 1
) -> str:
    """Start (or find running) the cluster next to `url`'s port, `replicas` replicas per
    primary; returns a node's URL."""
    if primaries < 3:
        raise UpError("--redis-cluster: a Redis Cluster needs at least 3 primaries")
    parts = urlsplit(url)
    host, first = parts.hostname or "127.0.0.1", (parts.port or 6379) + 1
    ports = list(range(first, first + (1 + replicas) * primaries))
    node_url = f"redis://{host}:{first}/0"
    if cluster_ok(host, first):
        print(f"inferq up: using the Redis Cluster at {node_url}")
        return node_url
    fresh = []
    for port in ports:
        if not port_free(host, port) or port + 10000 > 65535:
            raise UpError(f"--redis-cluster: port {port} (or its bus port) is not free")
        node_dir = data_dir / f"cluster-{port}"
        fresh.append(not (node_dir / "nodes.conf").exists())
        args = redis_server_args(
            host, port, node_dir,
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
        )  # fmt: skip
        system.spawn(
            f"redis-{port}",
            args,
            dict(os.environ),
            waits_for="it writes its data",
            hurry_signal=None,
        )
    give_up = time.monotonic() + CLUSTER_READY_S
    if all(fresh):
        _wait(lambda: all(_answers(host, port) for port in ports), give_up, system)
        _create(host, ports, replicas)
    _wait(lambda: cluster_ok(host, first), give_up, system)
    print(f"inferq up: started a Redis Cluster of {primaries} primaries at {node_url}")
    return node_url


def _answers(host: str, port: int) -> bool:
    try:
        client = redis.Redis(host=host, port=port, socket_connect_timeout=1, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


def _create(host: str, ports: list[int], replicas: int) -> None:
    cli = shutil.which("redis-cli")
    if cli is None:
        raise UpError("redis-cli not found: install it (it comes with redis-server)")
    nodes = [f"{host}:{port}" for port in ports]
    command = [
        cli,
        "--cluster",
        "create",
        *nodes,
        "--cluster-replicas",
        str(replicas),
        "--cluster-yes",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise UpError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")


def _wait(ready: Callable[[], bool], give_up: float, system: System) -> None:
    while not ready():
        if system.dead():
            names = ", ".join(child.name for child in system.dead())
            raise UpError(f"{names} exited while the cluster started (see its redis.log)")
        if time.monotonic() > give_up:
            raise UpError("the Redis Cluster did not come up in time (see the nodes' redis.log)")
        time.sleep(0.1)
