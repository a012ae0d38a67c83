"""What relaying tokens costs Redis: commands and CPU per streamed token, and the gaps a streaming
client sees between chunks.

    python bench/system/relay.py --jobs 200 --output-len 256 --workers 2 --live 40 \\
        --setting today:repo=/work/main --setting new:

Starts one redis-server on a free port, then for each `--setting` (in turn) `--workers`
`inferq worker` processes running the test suite's fake engine (tests/worker/worker_fakes.py:
tokens cost no model compute, so Redis and the worker loop are all there is). Each setting
serves `--jobs` streaming jobs of `--output-len` tokens; `--live` of them (spread over the
batch) are consumed as a client does (subscribe, replay, dedupe by chunk number:
`stream_chunks`, what SSE serves), the rest nobody listens to. Redis's own `used_cpu_user +
used_cpu_sys` and `INFO commandstats`, read before and after, give Redis CPU and commands per
token; everything Redis did in between counts (enqueues, reads, acks, the bench's own polls).

A setting is `NAME:key=value,...`: worker settings (as `INFERQ_<KEY>`), plus `repo=PATH` to run
the workers from another checkout (e.g. the main branch, to compare with today's relay in the
same run). Every client saw every chunk number once and all its tokens, or the run fails.

    python bench/system/relay.py --cluster-primaries 3 ...

also starts a Redis Cluster of that many primaries (no replicas, as the single server has
none; what `inferq up --redis-cluster-primaries` starts, same persistence) and runs each setting
on both, in turn: the same jobs, workers and clients. Each primary's CPU and commandstats are
read from that node. What this models: a Redis fleet's capacity is decided by its busiest
shard, one core each (Redis executes commands on one thread), so the capacity ratio is
(the single server's CPU per token) / (the busiest primary's CPU per token): how many times the
tokens/s the cluster relays before its busiest shard saturates. It is not a wall-clock
throughput ratio: on a small machine the primaries, workers and clients share the same few
cores, so the wall-clock tokens/s of each run (printed too) say how busy the machine was, not
what the cluster could do with a core per shard. What it leaves out: network hops between
hosts, and the cluster client's extra connections and MOVED handling in the clients.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from redis.asyncio import Redis

from bench.common.workload import bench_redis, unpinned
from bench.system.relay_cluster import Counters, Target, placement, read_counters, start_cluster
from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobField, JobStatus, RedisKeys
from schemas.keys import HEARTBEAT_INTERVAL_S

REPO = Path(__file__).resolve().parents[2]
MODEL = "relay-bench"
STARTUP_GAPS = 3  # a job's first gaps include its admission (and a subscriber's first look)


@dataclass(frozen=True)
class Setting:
    name: str
    env: dict[str, str]
    repo: Path

    @classmethod
    def parse(cls, text: str) -> Setting:
        name, _, rest = text.partition(":")
        env: dict[str, str] = {}
        repo = REPO
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key == "repo":
                repo = Path(value).resolve()
            else:
                env[f"INFERQ_{key.upper()}"] = value
        return cls(name or "default", env, repo)


@dataclass
class Figures:
    setting: str
    target: str
    tokens: int
    seconds: float
    commands: int
    cpu_s: float
    gaps_ms: list[float]
    steady_gaps_ms: list[float]  # without each job's first STARTUP_GAPS gaps
    chunks_per_job: float
    by_command: dict[str, tuple[int, int]] = field(default_factory=dict)  # calls, µs
    by_node: dict[str, Counters] = field(default_factory=dict)  # per primary
    placement: dict[str, str] = field(default_factory=dict)  # per primary: what it holds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def busiest_us_per_token(self) -> float:
        return max(c.cpu_s for c in self.by_node.values()) / self.tokens * 1e6

    def pct(self, q: float, gaps: list[float] | None = None) -> float:
        ordered = sorted(self.gaps_ms if gaps is None else gaps)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def worker_command(setting: Setting, args: argparse.Namespace, target: Target, index: int):
    fakes = setting.repo / "tests" / "worker"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(setting.repo), str(fakes)])
    seqs = args.max_num_seqs
    blocks = seqs * (-(-(args.prompt_tokens + args.output_len) // 16) + 1)
    env.update(
        INFERQ_ENGINE_FACTORY="worker_fakes:build_engine",
        INFERQ_MODEL=MODEL,
        INFERQ_NAME=f"relay-{setting.name}-{index}",
        INFERQ_MAX_NUM_SEQS=str(seqs),
        INFERQ_NUM_KV_BLOCKS=str(blocks),
        INFERQ_FAKE_STEP_SECONDS=str(args.step_ms / 1000),
        INFERQ_MAX_MODEL_LEN=str(args.prompt_tokens + args.output_len + 16),
    )
    env.update(target.worker_env())
    env.update(setting.env)
    return [sys.executable, "-m", "cli", "--log-level", "warning", "worker"], env, setting.repo


async def consume(client: AsyncRedisClient, job_id: str, output_len: int) -> list[float]:
    """Follow one job as a streaming client does; the gaps between chunks, in ms."""
    arrivals: list[float] = []
    indices: list[int] = []
    tokens = 0
    async for chunk in client.stream(job_id):
        arrivals.append(time.perf_counter())
        indices.append(chunk.index)
        tokens += len(chunk.token_ids)
    if indices != list(range(len(indices))) or tokens != output_len:
        raise RuntimeError(f"{job_id}: chunks {indices[:5]}..., {tokens} tokens")
    return [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]


async def wait_all_done(
    redis: Redis, keys: RedisKeys, job_ids: list[str], timeout_s: float
) -> None:
    left = list(job_ids)
    give_up = time.monotonic() + timeout_s
    while left:
        async with redis.pipeline(transaction=False) as pipe:
            for job_id in left:
                pipe.hget(keys.job(job_id), JobField.STATUS)
            statuses = await pipe.execute()
        left = [j for j, s in zip(left, statuses, strict=True) if s != JobStatus.SUCCEEDED.value]
        if left and time.monotonic() > give_up:
            raise RuntimeError(f"{len(left)} jobs unfinished after {timeout_s} s")
        if left:
            await asyncio.sleep(0.5)


async def wait_workers(
    redis: Redis, keys: RedisKeys, setting: Setting, count: int, children
) -> None:
    names = [keys.worker(f"relay-{setting.name}-{i}") for i in range(count)]
    while sum([await redis.exists(name) for name in names]) < count:
        for process, log in children:
            if process.poll() is not None:
                raise RuntimeError(f"a worker exited while starting; see {log}")
        await asyncio.sleep(0.2)


async def run_setting(setting: Setting, args: argparse.Namespace, target: Target) -> Figures:
    children = []
    for index in range(args.workers):
        command, env, cwd = worker_command(setting, args, target, index)
        log = Path(tempfile.mkstemp(prefix=f"relay-{setting.name}-", suffix=".log")[1])
        with log.open("wb") as out:
            process = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=out)
        children.append((process, log))
    redis = target.client()
    client = AsyncRedisClient(redis, poll_interval=1.0)
    keys = client.keys
    try:
        await wait_workers(redis, keys, setting, args.workers, children)
        # one more heartbeat: on a cluster the workers learn of each other (and split the
        # shards) with their heartbeats, and the run measures them settled, as a fleet runs
        await asyncio.sleep(HEARTBEAT_INTERVAL_S + 0.5)
        before = await read_counters(target)
        started = time.perf_counter()
        job_ids, consumers = [], []
        every = max(1, args.jobs // max(args.live, 1)) if args.live else 0
        for i in range(args.jobs):
            job = await client.enqueue(
                model=MODEL,
                prompt=f"job {i} ".ljust(args.prompt_tokens, "x"),  # a token per character
                sampling={"max_tokens": args.output_len},
                stream=True,
            )
            job_ids.append(job.id)
            if every and i % every == 0 and len(consumers) < args.live:
                consumers.append(asyncio.create_task(consume(client, job.id, args.output_len)))
        per_job = await asyncio.gather(*consumers)
        gaps = [g for gs in per_job for g in gs]
        steady = [g for gs in per_job for g in gs[STARTUP_GAPS:]]
        await wait_all_done(redis, keys, job_ids, args.timeout_s)
        seconds = time.perf_counter() - started
        after = await read_counters(target)
        chunks = sum([await redis.xlen(keys.out_stream(j)) for j in job_ids[:20]]) / min(
            20, len(job_ids)
        )
        held = placement(redis, keys, MODEL, job_ids)
    finally:
        for process, _ in children:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process, _ in children:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        await redis.aclose()
    by_node = {url: after[url].since(before[url]) for url in target.nodes}
    by_command: dict[str, tuple[int, int]] = {}
    for counters in by_node.values():
        for name, (calls, usec) in counters.calls.items():
            total = by_command.get(name, (0, 0))
            by_command[name] = (total[0] + calls, total[1] + usec)
    return Figures(
        setting=setting.name,
        target=target.name,
        tokens=args.jobs * args.output_len,
        seconds=seconds,
        commands=sum(c.commands for c in by_node.values()),
        cpu_s=sum(c.cpu_s for c in by_node.values()),
        gaps_ms=gaps,
        steady_gaps_ms=steady,
        chunks_per_job=chunks,
        by_command=by_command,
        by_node=by_node,
        placement=held,
    )


def print_table(results: list[Figures]) -> None:
    print(
        "| setting | chunks/job | Redis commands per token | Redis CPU per token | "
        "one Redis core relays | client gap p50 / p99 | p99 after a job's first gaps | wall |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        per_token_us = r.cpu_s / r.tokens * 1e6
        print(
            f"| {r.setting} on {r.target} | {r.chunks_per_job:.0f} | {r.commands / r.tokens:.2f} | "
            f"{per_token_us:.1f} µs | ~{1e6 / per_token_us:,.0f} tokens/s | "
            f"{r.pct(0.5):.1f} / {r.pct(0.99):.1f} ms | {r.pct(0.99, r.steady_gaps_ms):.1f} ms | "
            f"{r.seconds:.1f} s |"
        )
    for r in results:
        top = sorted(r.by_command.items(), key=lambda item: -item[1][1])[:8]
        line = ", ".join(
            f"{name} {calls / r.tokens:.3f} ({usec / r.tokens:.2f} µs)"
            for name, (calls, usec) in top
        )
        executing = sum(usec for _, usec in r.by_command.values()) / r.tokens
        print(f"# {r.setting} on {r.target}: per token, {executing:.1f} µs executing: {line}")


def print_cluster_table(results: list[Figures]) -> None:
    """Each cluster run against the single-server run of the same setting and round before it."""
    print(
        "| setting | single: CPU per token (reads per 1k tokens), tokens/s wall | cluster: CPU "
        "per token per primary (commands per token, reads per 1k tokens) | busiest primary | "
        "capacity ratio | cluster tokens/s wall |"
    )
    print("|---|---|---|---|---|---|")
    single: dict[str, Figures] = {}
    for r in results:
        if not r.placement:
            single[r.setting] = r
            continue
        base = single[r.setting]
        base_us = base.cpu_s / base.tokens * 1e6
        base_reads = sum(c.reads for c in base.by_node.values()) / base.tokens * 1000
        shards = ", ".join(
            f"{c.cpu_s / r.tokens * 1e6:.2f} µs ({c.commands / r.tokens:.2f}, "
            f"{c.reads / r.tokens * 1000:.0f})"
            for c in r.by_node.values()
        )
        busiest = r.busiest_us_per_token()
        print(
            f"| {r.setting} | {base_us:.2f} µs ({base_reads:.0f}), {base.tokens_per_s:,.0f} | "
            f"{shards} | "
            f"{busiest:.2f} µs | {base_us / busiest:.2f}x | {r.tokens_per_s:,.0f} |"
        )
        for url, held in r.placement.items():
            print(f"# {r.setting}: {url} holds {held}")
    for r in results:
        for url, counters in r.by_node.items():
            print(f"# {r.setting} on {r.target}, {url}: {node_breakdown(counters, r.tokens)}")


def node_breakdown(counters: Counters, tokens: int) -> str:
    """Where one Redis's CPU went, per 1k tokens: read events (round trips), replies, CPU
    outside command execution, and the commands that took the most."""
    executing = sum(usec for _, usec in counters.calls.values())
    top = sorted(counters.calls.items(), key=lambda item: -item[1][1])[:7]
    commands = ", ".join(
        f"{name} {calls * 1000 / tokens:.1f} ({usec * 1000 / tokens:.0f} µs)"
        for name, (calls, usec) in top
    )
    errors = ", ".join(
        f"{kind} {count * 1000 / tokens:.2f}" for kind, count in sorted(counters.errors.items())
    )
    return (
        f"per 1k tokens: {counters.reads * 1000 / tokens:.1f} reads, "
        f"{counters.writes * 1000 / tokens:.1f} writes, CPU {counters.cpu_s * 1e9 / tokens:.0f} µs "
        f"of which executing {executing * 1000 / tokens:.0f} µs; {commands}; "
        f"error replies: {errors or 'none'}; bus messages in: "
        f"{counters.bus_messages * 1000 / tokens:.1f}"
    )


async def run(args: argparse.Namespace) -> list[Figures]:
    settings = [Setting.parse(text) for text in args.setting]
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="relay-bench-") as data,
        bench_redis(Path(data) / "single") as (system, redis_url),
    ):
        targets = [Target.single(redis_url)]
        if args.cluster_primaries:
            with unpinned():
                cluster = start_cluster(system, args.cluster_primaries, Path(data) / "cluster")
            targets.append(cluster)
        for _ in range(args.rounds):
            for setting in settings:
                for target in targets:
                    figures = await run_setting(setting, args, target)
                    print(
                        f"# {figures.setting} on {figures.target}: "
                        f"{figures.cpu_s / figures.tokens * 1e6:.1f} µs/token",
                        flush=True,
                    )
                    results.append(figures)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--live", type=int, default=40, help="jobs followed by a stream client")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="per worker")
    parser.add_argument("--step-ms", type=float, default=0.0, help="the fake engine's step time")
    parser.add_argument("--rounds", type=int, default=1, help="run the settings in turn, N times")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--cluster-primaries",
        type=int,
        default=0,
        help="also run each setting on a Redis Cluster of N primaries (N >= 3)",
    )
    parser.add_argument(
        "--setting",
        action="append",
        default=None,
        help="NAME:key=value,... (worker settings; repo=PATH runs another checkout's worker)",
    )
    args = parser.parse_args()
    args.setting = args.setting or ["default:"]
    results = asyncio.run(run(args))
    print(
        f"# {args.jobs} jobs x {args.output_len} tokens, {args.workers} workers "
        f"(fake engine, step {args.step_ms} ms), {args.live} followed live"
    )
    print_table(results)
    if args.cluster_primaries:
        print_cluster_table(results)


if __name__ == "__main__":
    main()
