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

from bench.common.workload import bench_redis
from producer_api.client.redis_client import AsyncRedisClient
from schemas import JobField, JobStatus, RedisKeys

REPO = Path(__file__).resolve().parents[2]
MODEL = "relay-bench"
KEYS = RedisKeys()
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
    tokens: int
    seconds: float
    commands: int
    cpu_s: float
    gaps_ms: list[float]
    steady_gaps_ms: list[float]  # without each job's first STARTUP_GAPS gaps
    chunks_per_job: float
    by_command: dict[str, tuple[int, int]] = field(default_factory=dict)  # calls, µs

    def pct(self, q: float, gaps: list[float] | None = None) -> float:
        ordered = sorted(self.gaps_ms if gaps is None else gaps)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def worker_command(setting: Setting, args: argparse.Namespace, redis_url: str, index: int):
    fakes = setting.repo / "tests" / "worker"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(setting.repo), str(fakes)])
    seqs = args.max_num_seqs
    blocks = seqs * (-(-(args.prompt_tokens + args.output_len) // 16) + 1)
    env.update(
        INFERQ_ENGINE_FACTORY="worker_fakes:build_engine",
        INFERQ_MODEL=MODEL,
        INFERQ_REDIS_URL=redis_url,
        INFERQ_NAME=f"relay-{setting.name}-{index}",
        INFERQ_MAX_NUM_SEQS=str(seqs),
        INFERQ_NUM_KV_BLOCKS=str(blocks),
        INFERQ_FAKE_STEP_SECONDS=str(args.step_ms / 1000),
        INFERQ_MAX_MODEL_LEN=str(args.prompt_tokens + args.output_len + 16),
    )
    env.update(setting.env)
    return [sys.executable, "-m", "cli", "--log-level", "warning", "worker"], env, setting.repo


async def redis_counters(redis: Redis) -> tuple[float, dict[str, tuple[int, int]]]:
    """Redis's CPU seconds so far, and per command (calls, µs spent executing it)."""
    cpu = await redis.info("cpu")
    stats = await redis.info("commandstats")
    calls = {
        name.removeprefix("cmdstat_"): (int(value["calls"]), int(value["usec"]))
        for name, value in stats.items()
        if name not in ("cmdstat_info",)
    }
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), calls


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


async def wait_all_done(redis: Redis, job_ids: list[str], timeout_s: float) -> None:
    left = list(job_ids)
    give_up = time.monotonic() + timeout_s
    while left:
        async with redis.pipeline(transaction=False) as pipe:
            for job_id in left:
                pipe.hget(KEYS.job(job_id), JobField.STATUS)
            statuses = await pipe.execute()
        left = [j for j, s in zip(left, statuses, strict=True) if s != JobStatus.SUCCEEDED.value]
        if left and time.monotonic() > give_up:
            raise RuntimeError(f"{len(left)} jobs unfinished after {timeout_s} s")
        if left:
            await asyncio.sleep(0.5)


async def wait_workers(redis: Redis, setting: Setting, count: int, children) -> None:
    names = [KEYS.worker(f"relay-{setting.name}-{i}") for i in range(count)]
    while await redis.exists(*names) < count:
        for process, log in children:
            if process.poll() is not None:
                raise RuntimeError(f"a worker exited while starting; see {log}")
        await asyncio.sleep(0.2)


async def run_setting(setting: Setting, args: argparse.Namespace, redis_url: str) -> Figures:
    children = []
    for index in range(args.workers):
        command, env, cwd = worker_command(setting, args, redis_url, index)
        log = Path(tempfile.mkstemp(prefix=f"relay-{setting.name}-", suffix=".log")[1])
        with log.open("wb") as out:
            process = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=out)
        children.append((process, log))
    redis = Redis.from_url(redis_url, decode_responses=True)
    client = AsyncRedisClient(redis, poll_interval=1.0)
    try:
        await wait_workers(redis, setting, args.workers, children)
        cpu_before, calls_before = await redis_counters(redis)
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
        await wait_all_done(redis, job_ids, args.timeout_s)
        seconds = time.perf_counter() - started
        cpu_after, calls_after = await redis_counters(redis)
        chunks = sum([await redis.xlen(KEYS.out_stream(j)) for j in job_ids[:20]]) / min(
            20, len(job_ids)
        )
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
    by_command = {
        name: (calls - calls_before.get(name, (0, 0))[0], usec - calls_before.get(name, (0, 0))[1])
        for name, (calls, usec) in calls_after.items()
        if calls != calls_before.get(name, (0, 0))[0]
    }
    return Figures(
        setting=setting.name,
        tokens=args.jobs * args.output_len,
        seconds=seconds,
        commands=sum(calls for calls, _ in by_command.values()),
        cpu_s=cpu_after - cpu_before,
        gaps_ms=gaps,
        steady_gaps_ms=steady,
        chunks_per_job=chunks,
        by_command=by_command,
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
            f"| {r.setting} | {r.chunks_per_job:.0f} | {r.commands / r.tokens:.2f} | "
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
        print(f"# {r.setting}: per token, {executing:.1f} µs executing commands: {line}")


async def run(args: argparse.Namespace) -> list[Figures]:
    settings = [Setting.parse(text) for text in args.setting]
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="relay-bench-") as data,
        bench_redis(Path(data)) as (
            _,
            redis_url,
        ),
    ):
        for _ in range(args.rounds):
            for setting in settings:
                figures = await run_setting(setting, args, redis_url)
                print(
                    f"# {figures.setting}: {figures.cpu_s / figures.tokens * 1e6:.1f} µs/token",
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


if __name__ == "__main__":
    main()
