"""The Redis side of bench/system/relay.py: where a run's Redis is (one server, or a local Redis
Cluster that `inferq up` would start), each primary's CPU and commandstats, and which primary
holds what."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from cli.up_cluster import start_redis_cluster
from cli.up_system import System, port_free
from redis_io.clients import redis_client
from schemas import RedisKeys
from schemas.redis_connection import RedisConnectionSettings

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Target:
    """Where a run's Redis is: `url` for the clients, `nodes` the primaries whose INFO counts."""

    name: str
    url: str
    cluster: bool
    nodes: tuple[str, ...]

    @classmethod
    def single(cls, url: str) -> Target:
        return cls("single", url, False, (url,))

    def client(self) -> Redis:
        return redis_client(RedisConnectionSettings(redis_url=self.url, redis_cluster=self.cluster))

    def worker_env(self) -> dict[str, str]:
        env = {"INFERQ_REDIS_URL": self.url}
        if self.cluster:
            env["INFERQ_REDIS_CLUSTER"] = "true"
        return env


@dataclass(frozen=True)
class Counters:
    """One Redis's CPU seconds so far, per command (calls, µs spent executing it), and its
    read and write events (a client's pipeline is a read, its reply a write: what Redis pays
    per round trip, whatever the number of commands in it)."""

    cpu_s: float
    calls: dict[str, tuple[int, int]]
    reads: int = 0
    writes: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # error replies by kind (MOVED, ...)
    bus_messages: int = 0  # cluster bus messages received (0 off a cluster)

    def since(self, before: Counters) -> Counters:
        calls = {
            name: (n - before.calls.get(name, (0, 0))[0], us - before.calls.get(name, (0, 0))[1])
            for name, (n, us) in self.calls.items()
            if n != before.calls.get(name, (0, 0))[0]
        }
        errors = {
            kind: count - before.errors.get(kind, 0)
            for kind, count in self.errors.items()
            if count != before.errors.get(kind, 0)
        }
        return Counters(
            self.cpu_s - before.cpu_s,
            calls,
            self.reads - before.reads,
            self.writes - before.writes,
            errors,
            self.bus_messages - before.bus_messages,
        )

    @property
    def commands(self) -> int:
        return sum(calls for calls, _ in self.calls.values())


def start_cluster(system: System, primaries: int, data_dir: Path) -> Target:
    """A fresh cluster of `primaries` primaries without replicas (the single server it is
    compared with has none either), on free ports; children of `system`."""
    for _ in range(200):
        first = random.randint(20000, 55000 - primaries)
        ports = range(first, first + 1 + primaries)  # start_redis_cluster skips `first`
        if all(port_free(HOST, p) and port_free(HOST, p + 10000) for p in ports):
            break
    else:
        raise RuntimeError("no free block of ports for the cluster")
    url = start_redis_cluster(system, primaries, f"redis://{HOST}:{first}/0", data_dir, 0)
    nodes = tuple(f"redis://{HOST}:{port}/0" for port in ports[1:])
    return Target(f"cluster-{primaries}", url, True, nodes)


async def read_counters(target: Target) -> dict[str, Counters]:
    """Every primary's counters, each read from that node alone."""
    out = {}
    for url in target.nodes:
        node = Redis.from_url(url, decode_responses=True)
        try:
            cpu = await node.info("cpu")
            stats = await node.info("commandstats")
            io = await node.info("stats")
            errors = await node.info("errorstats")
            bus = await _bus_messages(node) if target.cluster else 0
        finally:
            await node.aclose()
        calls = {
            name.removeprefix("cmdstat_"): (int(value["calls"]), int(value["usec"]))
            for name, value in stats.items()
            if name != "cmdstat_info"
        }
        out[url] = Counters(
            float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            calls,
            int(io["total_reads_processed"]),
            int(io["total_writes_processed"]),
            {
                name.removeprefix("errorstat_"): int(value["count"])
                for name, value in errors.items()
            },
            bus,
        )
    return out


async def _bus_messages(node: Redis) -> int:
    """Cluster bus messages the node received so far (pings, pub/sub relays, ...)."""
    info = await node.execute_command("CLUSTER", "INFO")
    text = info if isinstance(info, str) else info.decode()
    for line in text.splitlines():
        name, _, value = line.strip().partition(":")
        if name == "cluster_stats_messages_received":
            return int(value)
    return 0


def placement(redis: Redis, keys: RedisKeys, model: str, job_ids: list[str]) -> dict[str, str]:
    """Per primary URL, how many of the jobs' own keys and which queue partitions it holds
    ('all' on a single server)."""
    if not isinstance(redis, RedisCluster):
        return {}
    jobs = Counter(_node_url(redis, keys.job(job_id)) for job_id in job_ids)
    partitions: dict[str, list[int]] = {}
    for k in range(keys.partitions):
        partitions.setdefault(_node_url(redis, keys.jobs_stream(model, k)), []).append(k)
    return {
        url: f"{jobs.get(url, 0)} jobs, partitions {partitions.get(url, [])}"
        for url in sorted(set(jobs) | set(partitions))
    }


def _node_url(redis: RedisCluster, key: str) -> str:
    node = redis.get_node_from_key(key)
    return f"redis://{HOST}:{node.port}/0"
