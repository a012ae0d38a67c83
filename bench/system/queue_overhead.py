"""What the queue costs: one workload through Redis + one worker vs in-process LLM.generate.

    python bench/system/queue_overhead.py --num-prompts 48 --input-len 160 --output-len 72

Same random workload as bench/engine/throughput.py (greedy, ignore_eos). In one run it starts its own
redis-server on a free port, measures `LLM.generate` in this process, then the same requests
enqueued at once into Redis and served by an `inferq worker` subprocess (streaming jobs, one
chunk per step unless --chunk-tokens says otherwise), timed from the first enqueue to the last
final chunk seen by a live subscriber. Reports both throughputs, their ratio, chunk delivery
latency (the worker's engine step returned -> the subscriber received the chunk) p50 / p99, and,
from the worker's own metrics, its steps' time next to the time its engine waited between them
(the loop's handoff: the queue's cost per step, free of the noise between two separate runs).
The two paths alternate for --repeats rounds (a fresh workload of the same sizes each round,
so the prefix cache never helps) and medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.figures import median_rates, print_row, quantile, rates
from bench.common.workload import (
    Request,
    add_workload_args,
    bench_redis,
    free_port,
    load_llm,
    token_counts,
    tune_cpu_runtime,
    unpinned,
    workload_line,
    workload_series,
)
from bench.engine.throughput import timed_generate
from cli.up_system import Child, System

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(parser)
    parser.add_argument(
        "--repeats", type=int, default=3, help="alternate both paths this many times"
    )
    parser.add_argument("--chunk-tokens", type=int, default=1, help="worker chunk coalescing")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    runtime = tune_cpu_runtime(args.threads)
    llm = load_llm(args)
    vocab = llm.engine.runner.vocab_size

    workload = workload_series(vars(args), vocab, args.seed)
    print(workload_line(workload(0)))
    print(f"# runtime: {runtime}")
    options = WorkerOptions(
        model=args.model,
        dtype=args.dtype,
        chunk_tokens=args.chunk_tokens,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    results = measure_queue_overhead(llm, options, workload, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


@dataclass
class WorkerOptions:
    """How to start the `inferq worker` that serves the queue path."""

    model: str
    dtype: str = "auto"
    chunk_tokens: int = 1
    threads: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    metrics_port: int = 0  # 0: a free one, chosen when the worker starts


def measure_queue_overhead(
    llm, options: WorkerOptions, workload: Callable[[int], list[Request]], repeats: int
) -> dict:
    """Alternate `llm.generate` in this process with the same requests through a fresh
    redis-server + one worker subprocess; medians of both, their ratio, chunk latencies."""
    # One untimed round of the real sizes through both paths first: the first workload of a
    # process pays one-time costs (first touch of KV-cache pages, allocator growth, oneDNN
    # primitives for new shapes) that a long-lived worker never pays again.
    warm = workload(repeats)  # a round index no repeat uses: no prefix-cache hits
    timed_generate(llm, warm)
    with (
        tempfile.TemporaryDirectory(prefix="inferq-bench-") as scratch,
        bench_redis(Path(scratch)) as (system, redis_url),
    ):
        trace = Path(scratch) / "chunks.trace"
        worker = start_worker(system, options, redis_url, trace)
        asyncio.run(wait_ready(redis_url, worker))
        asyncio.run(_queue_run(redis_url, options.model, warm, trace))
        inproc, queued, latencies, reference, tokens = [], [], [], [], []
        handoffs: list[StepTimings] = []
        ratios: list[float] = []
        for repeat in range(repeats):
            # A fresh workload per repeat (same sizes), so no repeat profits from the prefix
            # cache of the one before; both paths see it for the first time. The order of the
            # two paths alternates so a slow drift of the machine hits both alike.
            batch = workload(repeat)
            runs = {}
            for path in ("in-process", "queue") if repeat % 2 == 0 else ("queue", "in-process"):
                if path == "in-process":
                    runs[path], reference = timed_generate(llm, batch)
                else:
                    before = step_timings(options.metrics_port)
                    runs[path], lat, tokens = asyncio.run(
                        _queue_run(redis_url, options.model, batch, trace)
                    )
                    latencies += lat
                    handoffs.append(step_timings(options.metrics_port) - before)
            sizes = token_counts(batch)
            inproc.append(rates(runs["in-process"], *sizes))
            queued.append(rates(runs["queue"], *sizes))
            ratios.append(runs["in-process"] / runs["queue"])
            same = sum(a == b for a, b in zip(tokens, reference, strict=True))
            print(
                f"  repeat {repeat}: in-process {runs['in-process']:.2f} s, queue {runs['queue']:.2f} s, "
                f"ratio {ratios[-1]:.3f}, identical outputs {same}/{len(batch)}; "
                f"{handoffs[-1].describe()}"
            )

    results = {"in_process": median_rates(inproc), "queue": median_rates(queued)}
    # Paired: each repeat's two paths ran the same requests back to back, while repeats differ
    # in sizes and in what else the machine was doing.
    results["throughput_ratio"] = statistics.median(ratios)
    # The worker's engine steps next to what it spent between them (the loop's handoff), from
    # its own metrics: the queue's cost without the noise of comparing two separate runs.
    results["worker_steps"] = {
        "steps": statistics.median(h.steps for h in handoffs),
        "step_s": statistics.median(h.step_s for h in handoffs),
        "engine_wait_s": statistics.median(h.wait_s for h in handoffs),
    }
    latencies.sort()
    results["chunk_latency_ms"] = {
        "p50": 1000 * quantile(latencies, 0.50),
        "p99": 1000 * quantile(latencies, 0.99),
        "max": 1000 * latencies[-1] if latencies else float("nan"),
        "chunks": len(latencies),
    }
    print_row("in-process LLM.generate", results["in_process"], 32)
    print_row("Redis + 1 worker (streaming)", results["queue"], 32)
    print(
        f"throughput ratio (queue / in-process, median of repeats): {results['throughput_ratio']:.3f}"
    )
    steps = results["worker_steps"]
    print(
        f"worker (median of repeats): {steps['steps']:.0f} steps taking {steps['step_s']:.2f} s, "
        f"the engine waiting {1000 * steps['engine_wait_s']:.0f} ms between them "
        f"({100 * steps['engine_wait_s'] / steps['step_s']:.1f}% of its step time)"
    )
    lat = results["chunk_latency_ms"]
    print(
        f"chunk delivery latency (engine step -> subscriber): p50 {lat['p50']:.2f} ms, "
        f"p99 {lat['p99']:.2f} ms, max {lat['max']:.2f} ms over {lat['chunks']} chunks"
    )
    return results


# ---------------------------------------------------------------------------- the queue path


async def _queue_run(
    redis_url: str, model: str, requests: list[Request], trace: Path
) -> tuple[float, list[float], list]:
    """Enqueue every request at once; return (seconds to the last final chunk, per-chunk
    latencies in seconds, output token ids per request)."""
    from redis.asyncio import Redis

    from producer_api.queue import enqueue
    from schemas import JobRequest, RedisKeys

    keys = RedisKeys()
    trace.write_text("")
    redis = Redis.from_url(redis_url)
    pubsub = redis.pubsub()
    await pubsub.psubscribe(keys.channel("") + "*")
    while (await pubsub.get_message(timeout=1.0) or {}).get("type") != "psubscribe":
        pass
    received: dict[tuple[str, int], float] = {}
    tokens: dict[str, list[int]] = {}
    finals: set[str] = set()
    job_requests = [
        JobRequest(
            model=model,
            prompt_token_ids=r.prompt_token_ids,
            stream=True,
            sampling={"temperature": 0, "max_tokens": r.output_len, "ignore_eos": True},
        )
        for r in requests
    ]
    started = time.perf_counter()
    jobs = await asyncio.gather(*(enqueue(redis, keys, request) for request in job_requests))
    while len(finals) < len(jobs):
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=60.0)
        if message is None:
            raise RuntimeError("no chunk for 60 s: is the worker alive?")
        now = time.time()
        # A lean reader (json, not the pydantic models): on a small machine the subscriber
        # shares the CPU with the engine, and its cost is the client's, not the queue's.
        chunk = json.loads(message["data"])
        key = (chunk.get("job_id"), chunk.get("index"))
        if "event" in chunk or key in received:
            continue
        received[key] = now
        tokens.setdefault(key[0], []).extend(chunk.get("token_ids", ()))
        if chunk.get("final"):
            finals.add(key[0])
    seconds = time.perf_counter() - started
    await pubsub.aclose()
    await redis.aclose()
    await asyncio.sleep(0.2)  # let the worker's trace buffer reach the file
    emitted = _read_trace(trace)
    latencies = [received[key] - emitted[key] for key in received if key in emitted]
    return seconds, latencies, [tokens.get(job.id, []) for job in jobs]


def _read_trace(trace: Path) -> dict[tuple[str, int], float]:
    out = {}
    for line in trace.read_text().splitlines():
        job_id, index, at = line.split()
        out[(job_id, int(index))] = float(at)
    return out


@dataclass(frozen=True)
class StepTimings:
    """Totals of a worker's step-duration and engine-wait histograms (or their growth)."""

    steps: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0

    def __sub__(self, before: StepTimings) -> StepTimings:
        return StepTimings(
            self.steps - before.steps, self.step_s - before.step_s, self.wait_s - before.wait_s
        )

    def describe(self) -> str:
        per_step = 1000 * self.wait_s / max(self.steps, 1)
        return f"worker: {self.steps} steps, engine waits {per_step:.2f} ms a step"


def step_timings(port: int) -> StepTimings:
    """Scrape the worker's /metrics for its step and engine-wait totals."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return StepTimings(
        steps=int(totals.get("inferq_worker_step_seconds_count", 0)),
        step_s=totals.get("inferq_worker_step_seconds_sum", 0.0),
        wait_s=totals.get("inferq_worker_engine_wait_seconds_sum", 0.0),
    )


def start_worker(system: System, options: WorkerOptions, redis_url: str, trace: Path) -> Child:
    options.metrics_port = options.metrics_port or free_port()
    command = [
        sys.executable,
        "-m",
        "cli",
        "--log-level",
        os.environ.get("INFERQ_BENCH_WORKER_LOG", "warning"),
        "worker",
        "--model",
        options.model,
        "--redis-url",
        redis_url,
        "--name",
        "bench-worker",
        "--dtype",
        options.dtype,
        "--chunk-tokens",
        str(options.chunk_tokens),
        "--chunk-trace-path",
        str(trace),
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        str(options.metrics_port),
    ]
    for flag, value in (
        ("--num-threads", options.threads),
        ("--max-num-seqs", options.max_num_seqs),
        ("--max-num-batched-tokens", options.max_num_batched_tokens),
    ):
        if value:
            command += [flag, str(value)]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    with unpinned():
        return system.spawn(
            "worker", command, env, waits_for="its running jobs", hurry_signal=signal.SIGTERM
        )


async def wait_ready(redis_url: str, worker: Child) -> None:
    from redis.asyncio import Redis

    from schemas import RedisKeys

    redis = Redis.from_url(redis_url)
    try:
        while not await redis.exists(RedisKeys().worker("bench-worker")):
            if not worker.alive():
                raise RuntimeError("the worker exited while starting")
            await asyncio.sleep(0.2)
    finally:
        await redis.aclose()


if __name__ == "__main__":
    main()
