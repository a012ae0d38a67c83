"""Online serving: Poisson arrivals through the HTTP API (streaming), vs the in-process engine.

    python bench/system/serve.py --rates 0.5,1,2 --num-prompts 24 --input-len 128 --output-len 48

For each arrival rate (requests/s) the same random workload (bench/common/workload.py; greedy,
ignore_eos) is sent with exponential inter-arrival times, one `POST /v1/completions` with
`stream: true` per request, and every chunk's arrival is timed. Reported per rate, for the
HTTP path and for the same arrivals fed straight into an `engine.Engine` in this process:
TTFT, time per output token (TPOT = (end - first token) / (tokens - 1)), inter-token latency
(ITL, gaps between chunks), p50 / p99, and request and output-token throughput.

Without --url it starts its own system (a redis-server on a free port, the API via uvicorn and
one `inferq worker`), like `inferq up`; with --url it measures that deployment instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.workload import (
    Request,
    add_workload_args,
    bench_redis,
    describe_runtime,
    free_port,
    make_engine,
    unpinned,
    workload_series,
)


@dataclass
class Timeline:
    """One request: when it was sent, and when each chunk (with how many tokens) came."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if len(self.chunk_times) < 2 or self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


@dataclass
class RunReport:
    mode: str
    rate: float
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p90: float
    tpot_ms_p99: float
    itl_ms_p50: float
    itl_ms_p90: float
    itl_ms_p99: float


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Poisson process: exponential gaps with mean 1/rate (rate <= 0: all at once)."""
    if rate <= 0:
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def _ms_percentiles(values: list[float]) -> tuple[float, float, float]:
    """p50 / p90 / p99 in milliseconds (NaN when nothing was measured)."""
    if not values:
        return float("nan"), float("nan"), float("nan")
    p50, p90, p99 = np.percentile(np.asarray(values) * 1000.0, [50, 90, 99])
    return float(p50), float(p90), float(p99)


def summarize(mode: str, rate: float, timelines: list[Timeline], started: float) -> RunReport:
    ok = [t for t in timelines if t.error is None and t.chunk_times]
    end = max((t.chunk_times[-1] for t in ok), default=started)
    duration = max(end - started, 1e-9)
    latencies = {
        "ttft": [t.ttft for t in ok if t.ttft is not None],
        "tpot": [t.tpot for t in ok if t.tpot is not None],
        "itl": [gap for t in ok for gap in t.itls()],
    }
    percentiles = {
        f"{name}_ms_{p}": value
        for name, values in latencies.items()
        for p, value in zip(("p50", "p90", "p99"), _ms_percentiles(values), strict=True)
    }
    return RunReport(
        mode=mode,
        rate=rate,
        completed=len(ok),
        failed=len(timelines) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) / duration,
        output_token_throughput=sum(t.output_tokens for t in ok) / duration,
        **percentiles,
    )


# ------------------------------------------------------------------ the HTTP path


async def _one_http_request(
    http, model: str, request: Request, delay: float, start: float
) -> Timeline:
    await asyncio.sleep(max(start + delay - time.perf_counter(), 0.0))
    timeline = Timeline(sent=time.perf_counter())
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                timeline.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return timeline
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    timeline.error = payload["error"].get("message", "error")
                elif payload.get("choices"):
                    timeline.chunk_times.append(time.perf_counter())
                elif payload.get("usage"):
                    timeline.output_tokens = payload["usage"]["completion_tokens"]
    except Exception as exc:  # a benchmark reports failures, it does not stop on them
        timeline.error = f"{type(exc).__name__}: {exc}"
    return timeline


async def run_http(
    url: str, api_key: str, model: str, requests: list[Request], arrivals: list[float]
) -> tuple[list[Timeline], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=8)
    async with httpx.AsyncClient(
        base_url=url,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=httpx.Timeout(600.0),
        limits=limits,
    ) as http:
        start = time.perf_counter()
        timelines = await asyncio.gather(
            *(
                _one_http_request(http, model, request, delay, start)
                for request, delay in zip(requests, arrivals, strict=True)
            )
        )
    return list(timelines), start


@contextlib.contextmanager
def serving_system(model: str, data_dir: Path, worker_flags: list[str]) -> Iterator[str]:
    """redis-server + API + worker as children (cli.up does the spawning), stopped when the
    block ends; yields the API's URL once it is ready."""
    from cli.up_system import wait_ready

    with bench_redis(data_dir) as (system, redis_url):
        port = free_port()
        env = {**os.environ, "INFERQ_REDIS_URL": redis_url, "INFERQ_AUTH_DISABLED": "1"}
        env.pop("INFERQ_API_KEYS", None)
        with unpinned():
            system.spawn(
                "api",
                [
                    sys.executable, "-m", "uvicorn", "producer_api.app:create_app", "--factory",
                    "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                ],
                env,
                waits_for="open connections to close",
                hurry_signal=signal.SIGINT,
            )  # fmt: skip
            system.spawn(
                "worker",
                [sys.executable, "-m", "cli", "--log-level", "warning", "worker", "--model", model,
                 "--redis-url", redis_url, *worker_flags],
                env,
                waits_for="its running jobs",
                hurry_signal=signal.SIGTERM,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_ready(system, url, 600, want_worker=True)
        yield url


# ------------------------------------------------------------------ the in-process engine


def run_engine(
    engine, requests: list[Request], arrivals: list[float]
) -> tuple[list[Timeline], float]:
    """The same arrivals fed to an Engine in this process (no queue, no HTTP): the reference."""
    from engine import SamplingParams
    from engine.outputs import EngineRequest

    timelines = [Timeline(sent=0.0) for _ in requests]
    start = time.perf_counter()
    next_up, done = 0, 0
    while done < len(requests):
        now = time.perf_counter() - start
        while next_up < len(requests) and arrivals[next_up] <= now:
            request = requests[next_up]
            params = SamplingParams(temperature=0, max_tokens=request.output_len, ignore_eos=True)
            engine.add_request(EngineRequest(f"r{next_up}", request.prompt_token_ids, params))
            timelines[next_up].sent = time.perf_counter()
            next_up += 1
        if not engine.has_unfinished():
            time.sleep(max(arrivals[next_up] - (time.perf_counter() - start), 0.0))
            continue
        deltas = engine.step()
        stamp = time.perf_counter()
        for delta in deltas:
            index = int(delta.request_id[1:])
            if delta.token_ids:
                timelines[index].chunk_times.append(stamp)
                timelines[index].output_tokens += len(delta.token_ids)
            if delta.request_finished:
                done += 1
    return timelines, start


# ------------------------------------------------------------------ report


def print_table(reports: list[RunReport]) -> None:
    header = (
        f"{'mode':<7}{'rate':>6}{'ok':>5}{'fail':>5}{'req/s':>8}{'tok/s':>9}"
        f"{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'TPOT p50':>10}{'p99':>9}"
        f"{'ITL p50':>9}{'p90':>9}{'p99':>9}"
    )
    print(header + "   (latencies in ms)")
    for r in reports:
        print(
            f"{r.mode:<7}{r.rate:>6.2f}{r.completed:>5}{r.failed:>5}{r.request_throughput:>8.2f}"
            f"{r.output_token_throughput:>9.1f}{r.ttft_ms_p50:>10.1f}{r.ttft_ms_p90:>9.1f}"
            f"{r.ttft_ms_p99:>9.1f}{r.tpot_ms_p50:>10.1f}{r.tpot_ms_p99:>9.1f}"
            f"{r.itl_ms_p50:>9.1f}{r.itl_ms_p90:>9.1f}{r.itl_ms_p99:>9.1f}"
        )


def measure_serving(
    engine,
    model: str,
    workload: Callable[[int], list[Request]],
    rates: list[float],
    seed: int,
    worker_flags: list[str],
    url: str | None = None,
    api_key: str = "bench",
    http: bool = True,
) -> list[RunReport]:
    """Every rate through the in-process `engine` (None: skip) and then through HTTP (a system
    started here unless `url`); the same requests and arrivals for both paths at a rate."""
    reports: list[RunReport] = []
    if engine is not None:
        for index, rate in enumerate(rates):
            arrivals = arrival_times(len(workload(index)), rate, seed)
            timelines, start = run_engine(engine, workload(index), arrivals)
            reports.append(summarize("engine", rate, timelines, start))
    gc.collect()
    if not http:
        return sorted(reports, key=lambda r: (r.rate, r.mode))
    with (
        tempfile.TemporaryDirectory(prefix="inferq-serve-bench-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        if url is None:
            url = stack.enter_context(serving_system(model, Path(tmp), worker_flags))
        # One untimed request first: the worker's first batch pays one-time costs (lazy
        # initialisation, allocator growth) that the in-process engine already paid.
        warm = [Request(workload(0)[0].prompt_token_ids[:16], 2)]
        asyncio.run(run_http(url, api_key, model, warm, [0.0]))
        for index, rate in enumerate(rates):
            requests = workload(index)
            arrivals = arrival_times(len(requests), rate, seed)
            timelines, start = asyncio.run(run_http(url, api_key, model, requests, arrivals))
            for t in timelines:
                if t.error:
                    print(f"# failed request: {t.error}")
                    break
            reports.append(summarize("http", rate, timelines, start))
    reports.sort(key=lambda r: (r.rate, r.mode))
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(parser)
    parser.add_argument("--rates", default="0.5,1,2", help="requests/s, comma separated (0: burst)")
    parser.add_argument("--url", default=None, help="measure this API instead of starting one")
    parser.add_argument("--api-key", default="bench", help="key for --url")
    parser.add_argument("--skip-engine", action="store_true", help="no in-process reference")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument(
        "--worker-flag", action="append", default=[], help="extra `inferq worker` flag"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the reports as JSON")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r.strip()]

    engine = make_engine(args.model, args.dtype, args.seed, args.threads, prefix_caching=True)
    # A fresh workload of the same sizes per rate: a repeated one would find its whole
    # prompts in the prefix cache from the rate before and flatter every later rate.
    workload = workload_series(vars(args), engine.runner.vocab_size, args.seed, 104729)
    print(
        f"# serve bench: {args.num_prompts} requests per rate, input ~{args.input_len}, output "
        f"~{args.output_len} tokens, rates {rates} req/s; {describe_runtime()}"
    )
    flags = list(args.worker_flag)
    if args.threads:
        flags += ["--num-threads", str(args.threads)]
    reports = measure_serving(
        None if args.skip_engine else engine,
        args.model,
        workload,
        rates,
        args.seed,
        flags,
        url=args.url,
        api_key=args.api_key,
        http=not args.skip_http,
    )
    print_table(reports)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=2))


if __name__ == "__main__":
    main()
