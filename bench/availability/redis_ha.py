"""What Redis high availability costs and how fast it heals, on local redis-server processes.

    python bench/availability/redis_ha.py                      # both parts, defaults below
    python bench/availability/redis_ha.py --enqueues 2000 --failovers 5

1. Enqueue latency (the Python client's `enqueue`, the code path the API uses) against a master
   with one replica: without replica acknowledgement (`redis_wait_replicas=0`) and with it
   (`WAIT 1`), p50 and p99 over `--enqueues` sequential calls.
2. Failover: a master, a replica and three Sentinels (down-after 1 s); a client through the
   Sentinels enqueues every 10 ms; the master is SIGKILLed; the time until the Sentinels name
   the replica, and until the first new job is accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.availability.sentinel_cluster import (
    DOWN_AFTER_MS,
    MASTER_NAME,
    SentinelCluster,
    redis_binary,
)
from producer_api.client.redis_client import AsyncRedisClient
from producer_api.queue import REDIS_UNAVAILABLE
from schemas.redis_connection import RedisConnectionSettings

MODEL = "bench-model"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def enqueue_latencies(where: RedisConnectionSettings, count: int) -> list[float]:
    """Milliseconds per enqueue, after a warm-up."""
    async with AsyncRedisClient(where, prefix="bench") as client:
        for _ in range(50):
            await client.enqueue(model=MODEL, prompt="warm up")
        took = []
        for i in range(count):
            started = time.perf_counter()
            await client.enqueue(model=MODEL, prompt=f"job {i}")
            took.append((time.perf_counter() - started) * 1000)
    return took


def latency_part(binary: str, count: int) -> list[str]:
    rows = ["| replica acknowledgement | p50 ms | p99 ms | mean ms |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as scratch:
        pair = SentinelCluster(Path(scratch), binary, sentinel_count=1)
        pair.start(sentinels=False)
        try:
            url = f"redis://127.0.0.1:{pair.master_port}/0"
            for replicas, label in ((0, "none (WAIT off)"), (1, "WAIT 1 (one replica)")):
                where = RedisConnectionSettings(redis_url=url, redis_wait_replicas=replicas)
                took = asyncio.run(enqueue_latencies(where, count))
                rows.append(
                    f"| {label} | {percentile(took, 0.5):.3f} | {percentile(took, 0.99):.3f} "
                    f"| {statistics.fmean(took):.3f} |"
                )
        finally:
            pair.stop()
    return rows


async def first_accept_after_kill(cluster: SentinelCluster) -> tuple[float, float]:
    """(seconds until the replica is named master, seconds until an enqueue succeeds)."""
    where = RedisConnectionSettings(
        redis_sentinels=cluster.sentinels, redis_master_name=MASTER_NAME, redis_wait_replicas=0
    )
    async with AsyncRedisClient(where, prefix="bench") as client:
        await client.enqueue(model=MODEL, prompt="before")
        killed_at = time.monotonic()
        cluster.kill_master()
        promotion = asyncio.create_task(asyncio.to_thread(cluster.wait_promoted))
        while True:
            try:
                await client.enqueue(model=MODEL, prompt="after")
                break
            except REDIS_UNAVAILABLE:
                await asyncio.sleep(0.01)
        accepted = time.monotonic() - killed_at
        promoted = await promotion
    return promoted, accepted


def failover_part(binary: str, runs: int) -> list[str]:
    rows = [
        "| run | replica named master (s) | first job accepted (s) |",
        "|---|---|---|",
    ]
    for run in range(1, runs + 1):
        with tempfile.TemporaryDirectory() as scratch:
            cluster = SentinelCluster(Path(scratch), binary)
            cluster.start()
            try:
                promoted, accepted = asyncio.run(first_accept_after_kill(cluster))
            finally:
                cluster.stop()
        rows.append(f"| {run} | {promoted:.2f} | {accepted:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--enqueues", type=int, default=1000, help="timed enqueues per mode")
    parser.add_argument("--failovers", type=int, default=3, help="master kills (fresh set each)")
    args = parser.parse_args(argv)
    binary = redis_binary()
    if binary is None:
        print("redis-server not found", file=sys.stderr)
        return 2
    print(f"Enqueue latency, {args.enqueues} sequential enqueues, master + 1 replica (local):\n")
    print("\n".join(latency_part(binary, args.enqueues)))
    print(f"\nFailover after SIGKILL of the master (Sentinel down-after {DOWN_AFTER_MS} ms):\n")
    print("\n".join(failover_part(binary, args.failovers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
