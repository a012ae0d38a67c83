"""What one job keeps in Redis: the numbers behind the README's sizing rule.

    python bench/system/redis_footprint.py --jobs 20 --prompt-words 80 --output-len 256 --chunk-tokens 1 8

Starts its own redis-server. Jobs are chat requests (a system and a user message of about
`--prompt-words` words, `--output-len` generated tokens, streaming). First a backlog of
`--queued-jobs` that no worker takes: what a queued job costs. Then, for each `--chunk-tokens`
value, a real `inferq worker` serves a batch of `--jobs` and then a second one, which is
measured: what each finished job keeps until its TTLs end. Reported per job: `MEMORY USAGE` of
its job hash (request, result, timings) and of its replay stream (one entry per chunk), and the
growth of the memory all keys take (MEMORY STATS: allocated less client buffers and other
server costs), which also counts the keyspace's own tables and the stream entry; the batch
before the measured one paid for what is created once (streams, groups).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.workload import bench_redis
from bench.system.queue_overhead import WorkerOptions, start_worker, wait_ready
from cli.up_system import System
from schemas.defaults import DEFAULT_MODEL

# MEMORY STATS entries that are not the keys' (they do count against maxmemory: leave room).
NOT_KEYS = (
    "startup.allocated",
    "replication.backlog",
    "clients.slaves",
    "clients.normal",
    "aof.buffer",
    "lua.caches",
    "functions.caches",
)
QUEUED_MODEL = "footprint-backlog"  # no worker serves it
WORDS = [
    "the",
    "a",
    "model",
    "queue",
    "worker",
    "request",
    "token",
    "stream",
    "reply",
    "answer",
    "please",
    "explain",
    "how",
    "why",
    "what",
    "when",
    "data",
    "system",
    "customer",
    "order",
    "invoice",
    "summary",
    "report",
    "table",
    "value",
    "error",
    "result",
    "step",
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


@dataclass
class Footprint:
    """Bytes per job, medians over the jobs of one batch; `used_memory` is the growth of the
    keys' memory per job of the batch (the batch before it paid for what is created once)."""

    job_hash: float
    replay_stream: float
    chunks: float
    used_memory: float

    def row(self, label: str) -> str:
        per_chunk = self.replay_stream / self.chunks if self.chunks else float("nan")
        stream = f"replay stream {self.replay_stream:>6.0f} B ({self.chunks:.0f} chunks, "
        stream += f"{per_chunk:.0f} B each)" if self.chunks else "none)"
        return (
            f"{label:<26} job hash {self.job_hash:>5.0f} B   {stream:<44}   "
            f"all keys +{self.used_memory:.0f} B/job"
        )


class Bench:
    def __init__(self, redis_url: str, args: argparse.Namespace) -> None:
        from redis.asyncio import Redis

        from schemas import RedisKeys

        self.redis = Redis.from_url(redis_url, decode_responses=True)
        self.keys = RedisKeys()
        self.args = args
        self.rng = random.Random(args.seed)

    async def used_memory(self) -> int:
        """Memory the keys take, with the keyspace's own tables: what Redis allocated, less
        client buffers and other per-server costs (MEMORY STATS)."""
        stats = await self.redis.memory_stats()
        return int(stats["total.allocated"]) - sum(int(stats[name]) for name in NOT_KEYS)

    async def enqueue(self, count: int, model: str) -> list[str]:
        from producer_api.queue import enqueue
        from schemas import JobRequest

        args, ids = self.args, []
        for _ in range(count):
            system, user = args.prompt_words // 4, args.prompt_words - args.prompt_words // 4
            request = JobRequest(
                model=model,
                messages=[
                    {"role": "system", "content": _text(self.rng, system)},
                    {"role": "user", "content": _text(self.rng, user)},
                ],
                stream=True,
                sampling={"max_tokens": args.output_len, "temperature": 0.7, "ignore_eos": True},
            )
            ids.append((await enqueue(self.redis, self.keys, request)).id)
        return ids

    async def wait(self, ids: list[str]) -> None:
        while True:
            statuses = {await self.redis.hget(self.keys.job(i), "status") for i in ids}
            if statuses <= {"succeeded", "failed", "cancelled", "expired"}:
                assert statuses == {"succeeded"}, statuses
                return
            await asyncio.sleep(0.5)

    async def footprint(self, ids: list[str], before: int) -> Footprint:
        hashes = [await self.redis.memory_usage(self.keys.job(i), samples=0) for i in ids]
        streams = [await self.redis.memory_usage(self.keys.out_stream(i), samples=0) for i in ids]
        chunks = [await self.redis.xlen(self.keys.out_stream(i)) for i in ids]
        return Footprint(
            statistics.median(hashes),
            statistics.median(s or 0 for s in streams),
            statistics.median(chunks),
            (await self.used_memory() - before) / len(ids),
        )

    async def queued(self) -> Footprint:
        """A backlog of `--queued-jobs` with no worker to take them (a queue of its own)."""
        await self.redis.flushall()
        await self.enqueue(50, QUEUED_MODEL)
        before = await self.used_memory()
        footprint = await self.footprint(
            await self.enqueue(self.args.queued_jobs, QUEUED_MODEL), before
        )
        await self.redis.flushall()
        return footprint

    async def finished(self) -> Footprint:
        """One batch served, then another; the footprint of the second."""
        await self.wait(await self.enqueue(self.args.jobs, self.args.model))
        before = await self.used_memory()
        batch = await self.enqueue(self.args.jobs, self.args.model)
        await self.wait(batch)
        return await self.footprint(batch, before)

    async def aclose(self) -> None:
        await self.redis.aclose()


def _run(redis_url: str, args: argparse.Namespace, step: str) -> Footprint:
    async def run() -> Footprint:
        bench = Bench(redis_url, args)
        try:
            return await (bench.queued() if step == "queued" else bench.finished())
        finally:
            await bench.aclose()

    return asyncio.run(run())


def _served(
    system: System, redis_url: str, args: argparse.Namespace, chunk_tokens: int, scratch: Path
) -> None:
    options = WorkerOptions(model=args.model, chunk_tokens=chunk_tokens)
    worker = start_worker(system, options, redis_url, scratch / "trace")
    try:
        asyncio.run(wait_ready(redis_url, worker))
        print(_run(redis_url, args, "finished").row(f"finished, chunk_tokens={chunk_tokens}"))
    finally:
        worker.stop(lambda: False)
        system.children.remove(worker)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--jobs", type=int, default=20, help="jobs served per measurement")
    parser.add_argument("--queued-jobs", type=int, default=500, help="backlog measured")
    parser.add_argument("--prompt-words", type=int, default=80)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with (
        tempfile.TemporaryDirectory(prefix="inferq-footprint-") as scratch,
        bench_redis(Path(scratch)) as (system, redis_url),
    ):
        print(_run(redis_url, args, "queued").row("queued (no worker)"))
        for chunk_tokens in args.chunk_tokens:
            _served(system, redis_url, args, chunk_tokens, Path(scratch))


if __name__ == "__main__":
    main()
