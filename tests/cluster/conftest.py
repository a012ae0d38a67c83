"""A real Redis Cluster for the cluster tests: 3 primaries with a replica each, every node a
`redis-server --cluster-enabled yes` child process on a free port (AOF with fsync on every
write), joined by `redis-cli --cluster create`. Replicas take over a SIGKILLed primary after
the cluster's node timeout (1 s here)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RedisServer, find_redis_binary

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))  # worker_fakes, harness
sys.path.insert(0, str(Path(__file__).resolve().parent))  # cluster_helpers

PRIMARIES = 3
NODE_TIMEOUT_MS = 1000
READY_TIMEOUT_S = 30.0


def _cli(port: int, *args: str) -> str:
    out = subprocess.run(
        ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=30
    )
    return out.stdout


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_start() -> int:
    """The first port the kernel hands out to outgoing connections (Linux's default otherwise)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _cluster_port() -> int:
    """A free port whose cluster-bus twin (port + 10000) is free too. Both lie below the
    ephemeral range where the machine allows: a port checked free there can be taken by any
    outgoing connection before the node binds it (the bus port most of all)."""
    high = _ephemeral_start() - 10001
    low, high = (11000, high) if high > 12000 else (20000, 55535)
    for _ in range(1000):
        port = random.randint(low, high)
        if _free(port) and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _port_taken(error: RuntimeError) -> bool:
    return "Address already in use" in str(error)


class RedisClusterProcesses:
    """The nodes of one local cluster; `url` names one node (the client finds the rest)."""

    def __init__(self, binary: str, data_dir: Path, primaries: int, replicas: int) -> None:
        args = (
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--maxmemory-policy", "noeviction",
            # a replica takes over however long its link was down (a test kills at any time)
            "--cluster-replica-validity-factor", "0",
        )  # fmt: skip
        count = primaries * (1 + replicas)
        self.nodes = [
            RedisServer(binary, data_dir / f"node{i}", port=_cluster_port(), extra_args=args)
            for i in range(count)
        ]
        self.replicas = replicas

    @property
    def url(self) -> str:
        alive = next(node for node in self.nodes if node.running)
        return f"redis://127.0.0.1:{alive.port}/0"

    def start(self) -> None:
        for node in self.nodes:
            self._start_node(node)
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        create = subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses,
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if create.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed:\n{create.stdout}{create.stderr}"
            )
        self.wait_ready()

    @staticmethod
    def _start_node(node: RedisServer, attempts: int = 5) -> None:
        """Start a node that has not joined the cluster yet, on another port pair when another
        process took its port (or bus port) since it was checked free."""
        for attempt in range(attempts):
            try:
                node.start()
                return
            except RuntimeError as exc:
                if not _port_taken(exc) or attempt == attempts - 1:
                    raise
                (node.data_dir / "nodes.conf").unlink(missing_ok=True)  # written before the bind
                node.port = _cluster_port()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until every live node says the cluster is ok and every slot has a live primary."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [node for node in self.nodes if node.running]
            infos = [_cli(node.port, "cluster", "info") for node in live]
            ports = {node.port for node in live}
            healthy = all("cluster_state:ok" in i and "cluster_slots_ok:16384" in i for i in infos)
            if (
                healthy
                and all(self._slot_owners(node.port) <= ports for node in live)
                and all(self._link_up(node.port) for node in live)
            ):
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis Cluster did not become ready")

    @staticmethod
    def _slot_owners(port: int) -> set[int]:
        """The ports of the primaries that serve slots, as the node on `port` sees them."""
        owners = set()
        for line in _cli(port, "cluster", "nodes").splitlines():
            parts = line.split()
            if len(parts) > 8 and "master" in parts[2]:
                owners.add(int(parts[1].split("@")[0].rsplit(":", 1)[1]))
        return owners

    @staticmethod
    def _link_up(port: int) -> bool:
        """A replica synced with a live primary (a primary: always)."""
        info = _cli(port, "info", "replication")
        return "role:master" in info or "master_link_status:up" in info

    def primaries(self) -> list[RedisServer]:
        """The live nodes that are primaries now."""
        out = []
        for node in self.nodes:
            if node.running and "role:master" in _cli(node.port, "info", "replication"):
                out.append(node)
        return out

    def primary_of(self, key: str) -> RedisServer:
        """The live node that serves `key`'s slot now."""
        live = next(node for node in self.nodes if node.running)
        slot = int(_cli(live.port, "cluster", "keyslot", key).strip())
        for line in _cli(live.port, "cluster", "nodes").splitlines():
            parts = line.split()
            if "master" not in parts[2] or "fail" in parts[2]:
                continue
            for span in parts[8:]:
                low, _, high = span.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
                    return next(node for node in self.nodes if node.port == port)
        raise RuntimeError(f"no live primary serves {key!r}")

    def flush(self) -> None:
        for node in self.primaries():
            _cli(node.port, "flushall")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    """A 3-primary cluster with one replica per primary, shared by a test module (a test that
    kills a node should use `private_redis_cluster`)."""
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli not found (it comes with redis-server)")
    cluster = RedisClusterProcesses(
        find_redis_binary(), tmp_path_factory.mktemp("redis-cluster"), PRIMARIES, 1
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: RedisClusterProcesses) -> str:
    """The shared cluster's URL, every primary flushed first."""
    redis_cluster.wait_ready()
    redis_cluster.flush()
    return redis_cluster.url


@pytest.fixture
def private_redis_cluster(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    """A cluster of this test's own, to kill nodes of."""
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli not found (it comes with redis-server)")
    cluster = RedisClusterProcesses(find_redis_binary(), tmp_path / "cluster", PRIMARIES, 1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
