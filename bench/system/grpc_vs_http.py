"""The gRPC API vs the HTTP API, in one run against one system: unary latency and streaming
inter-token latency at a few concurrencies.

    python bench/system/grpc_vs_http.py --concurrency 1,4,16 --requests 32 --stream-tokens 32
    python bench/system/grpc_vs_http.py --fake-engine      # the transports alone, no model compute

Starts a redis-server on a free port, the HTTP API (uvicorn), the gRPC API (`inferq grpc`) and
one worker, all reading the same queue. For each concurrency C, C clients per transport each
send their share of `--requests` one after another:

- unary: a short prompt for 1 token (`POST /v1/completions` vs `CreateCompletion`), the time
  from sending to the whole answer;
- streaming: `--stream-tokens` tokens, greedy with ignore_eos (`POST /v1/completions` with
  `stream: true` vs `StreamCompletion`), the gaps between chunks (ITL) and the first chunk's
  time (TTFT).

The transports take turns (gRPC, HTTP, gRPC, HTTP) so a drifting machine favours neither.
`--fake-engine` runs the worker on the test suite's fake engine (tests/worker/worker_fakes.py)
with `--fake-step-s` per step, which leaves only what the transports and the queue add.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common.workload import bench_redis, free_port, unpinned  # noqa: E402

FAKE_MODEL = "fake-model"
SHORT_PROMPT = [9, 42, 7, 13]  # token ids: the same prompt for either engine, no tokenizer
STREAM_PROMPT = [17, 23, 5, 88, 61, 12, 3, 44]
ROUNDS = 2  # turns per transport at each concurrency


@dataclass
class Samples:
    unary_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Row:
    transport: str
    concurrency: int
    unary_p50_ms: float
    unary_p99_ms: float
    ttft_p50_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    requests: int
    errors: int


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000) if values else float("nan")


# ------------------------------------------------------------------------------- clients


class HttpClient:
    def __init__(self, url: str, model: str) -> None:
        import httpx

        self.model = model
        self.http = httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(600.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
        )

    async def unary(self) -> None:
        body = {"model": self.model, "prompt": SHORT_PROMPT, "max_tokens": 1, "temperature": 0}
        response = await self.http.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")

    async def stream(self, tokens: int) -> list[float]:
        body = {
            "model": self.model,
            "prompt": STREAM_PROMPT,
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        times = []
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"choices":[{' in line:
                    times.append(time.perf_counter())
        return times

    async def close(self) -> None:
        await self.http.aclose()


class GrpcClient:
    def __init__(self, address: str, model: str) -> None:
        from grpc import aio

        from producer_api.grpc.stubs import inference_pb2, inference_pb2_grpc

        self.pb = inference_pb2
        self.model = model
        self.channel = aio.insecure_channel(address)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)

    async def unary(self) -> None:
        request = self.pb.CompletionsRequest(
            model_id=self.model, prompt_token_ids=SHORT_PROMPT, num_tokens=1, temperature=0
        )
        await self.stub.CreateCompletion(request, timeout=600)

    async def stream(self, tokens: int) -> list[float]:
        request = self.pb.CompletionsRequest(
            model_id=self.model,
            prompt_token_ids=STREAM_PROMPT,
            num_tokens=tokens,
            temperature=0,
            ignore_eos=True,
        )
        times = []
        call = self.stub.StreamCompletion(
            self.pb.StreamCompletionRequest(completion=request), timeout=600
        )
        async for chunk in call:
            if chunk.token_ids or chunk.text:
                times.append(time.perf_counter())
        return times

    async def close(self) -> None:
        await self.channel.close()


Client = HttpClient | GrpcClient


# ----------------------------------------------------------------------------- measuring


async def _spread(concurrency: int, total: int, one: Callable[[], Awaitable[None]]) -> None:
    """`total` calls of `one`, by `concurrency` loops each calling one after another."""

    async def loop(count: int) -> None:
        for _ in range(count):
            await one()

    shares = [total // concurrency + (i < total % concurrency) for i in range(concurrency)]
    await asyncio.gather(*(loop(n) for n in shares if n))


async def measure(
    client: Client, concurrency: int, requests: int, tokens: int, into: Samples
) -> None:
    async def unary() -> None:
        started = time.perf_counter()
        try:
            await client.unary()
        except Exception as exc:  # a benchmark counts failures, it does not stop on them
            into.errors.append(f"{type(exc).__name__}: {exc}")
            return
        into.unary_s.append(time.perf_counter() - started)

    async def stream() -> None:
        started = time.perf_counter()
        try:
            times = await client.stream(tokens)
        except Exception as exc:
            into.errors.append(f"{type(exc).__name__}: {exc}")
            return
        if times:
            into.ttft_s.append(times[0] - started)
            into.itl_s.extend(b - a for a, b in itertools.pairwise(times))

    await _spread(concurrency, requests, unary)
    await _spread(concurrency, max(requests // 4, concurrency), stream)


async def run(args: argparse.Namespace, http_url: str, grpc_address: str, model: str) -> list[Row]:
    clients: dict[str, Client] = {
        "grpc": GrpcClient(grpc_address, model),
        "http": HttpClient(http_url, model),
    }
    rows = []
    try:
        for client in clients.values():  # warm-up: connections, the worker's first steps
            await measure(client, 2, 4, 4, Samples())
        for concurrency in args.concurrency:
            samples = {name: Samples() for name in clients}
            for _ in range(ROUNDS):
                for name, client in clients.items():
                    per_round = max(args.requests // ROUNDS, concurrency)
                    await measure(client, concurrency, per_round, args.stream_tokens, samples[name])
            for name, got in samples.items():
                rows.append(
                    Row(
                        name,
                        concurrency,
                        _ms(got.unary_s, 50),
                        _ms(got.unary_s, 99),
                        _ms(got.ttft_s, 50),
                        _ms(got.itl_s, 50),
                        _ms(got.itl_s, 99),
                        len(got.unary_s) + len(got.ttft_s),
                        len(got.errors),
                    )
                )
                if got.errors:
                    print(f"{name} at {concurrency}: {got.errors[0]}", file=sys.stderr)
    finally:
        for client in clients.values():
            await client.close()
    return rows


# -------------------------------------------------------------------------------- system


def start_system(system, redis_url: str, args: argparse.Namespace) -> tuple[str, str, str]:
    """The HTTP API, the gRPC API and a worker on `redis_url`; their addresses and the model."""
    from cli.up_system import wait_listening, wait_ready

    env = {**os.environ, "INFERQ_REDIS_URL": redis_url, "INFERQ_AUTH_DISABLED": "1"}
    env.pop("INFERQ_API_KEYS", None)
    model = args.model
    if args.fake_engine:
        model = FAKE_MODEL
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests" / "worker")])
        env["INFERQ_ENGINE_FACTORY"] = "worker_fakes:build_engine"
        env["INFERQ_FAKE_STEP_SECONDS"] = str(args.fake_step_s)
    http_port, grpc_port = free_port(), free_port()
    cli = [sys.executable, "-m", "cli", "--log-level", "warning"]
    with unpinned():
        system.spawn(
            "api",
            [
                sys.executable, "-m", "uvicorn", "producer_api.app:create_app", "--factory",
                "--host", "127.0.0.1", "--port", str(http_port), "--log-level", "warning",
            ],
            env,
            waits_for="open connections to close",
            hurry_signal=signal.SIGINT,
        )  # fmt: skip
        system.spawn(
            "grpc",
            [*cli, "grpc", "--host", "127.0.0.1", "--port", str(grpc_port)],
            env,
            waits_for="open calls to end",
            hurry_signal=None,
        )
        system.spawn(
            "worker",
            [*cli, "worker", "--model", model, "--redis-url", redis_url],
            env,
            waits_for="its running jobs",
            hurry_signal=signal.SIGTERM,
        )
    http_url = f"http://127.0.0.1:{http_port}"
    wait_ready(system, http_url, 600, want_worker=True)
    wait_listening(system, "127.0.0.1", grpc_port, 60)
    return http_url, f"127.0.0.1:{grpc_port}", model


def print_table(rows: list[Row]) -> None:
    print(
        "| transport | concurrency | unary p50 ms | unary p99 ms | stream TTFT p50 ms "
        "| ITL p50 ms | ITL p99 ms | requests | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.transport} | {r.concurrency} | {r.unary_p50_ms:.1f} | {r.unary_p99_ms:.1f} "
            f"| {r.ttft_p50_ms:.1f} | {r.itl_p50_ms:.1f} | {r.itl_p99_ms:.1f} | {r.requests} "
            f"| {r.errors} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=32, help="unary calls per concurrency")
    parser.add_argument("--stream-tokens", type=int, default=32)
    parser.add_argument("--fake-engine", action="store_true", help="the transports alone")
    parser.add_argument("--fake-step-s", type=float, default=0.02)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    with (
        tempfile.TemporaryDirectory() as data_dir,
        bench_redis(Path(data_dir)) as (system, redis_url),
    ):
        http_url, grpc_address, model = start_system(system, redis_url, args)
        started = time.perf_counter()
        rows = asyncio.run(run(args, http_url, grpc_address, model))
        print(f"model {model}, measured in {time.perf_counter() - started:.0f} s")
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
