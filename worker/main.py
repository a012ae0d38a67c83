"""Process entry of a worker: `python -m worker --model NAME [--redis-url URL] [--name NAME]`.

SIGTERM and SIGINT stop pulling, let running jobs finish for up to the drain timeout, hand the
rest back to the queue and exit 0; a second signal ends the drain at once. Every option can also
be set in the environment as INFERQ_<OPTION> (see `worker.settings.WorkerSettings`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from worker.logs import configure_logging

# CLI flag -> settings field, for the flags `add_worker_arguments` defines.
_FLAGS = (
    "model",
    "served_model_name",
    "redis_url",
    "prefix",
    "name",
    "num_kv_blocks",
    "kv_cache_memory",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "dtype",
    "device",
    "num_threads",
    "max_pull",
    "max_attempts",
    "claim_min_idle_ms",
    "chunk_tokens",
    "chunk_interval_ms",
    "drain_timeout_s",
    "metrics_port",
    "engine_factory",
    "chunk_trace_path",
)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The `inferq worker` options (defaults None: the environment / settings default wins)."""
    add = parser.add_argument
    add("--model", help="model to load (registry name, HF folder or hub id)")
    add("--served-model-name", help="queue name jobs use for this model (default: --model)")
    add("--redis-url", help="e.g. redis://localhost:6379/0")
    add("--prefix", help="Redis key prefix")
    add("--name", help="consumer name (unique per worker; default host-pid-random)")
    add("--num-kv-blocks", type=int)
    add("--kv-cache-memory", type=int, help="bytes of KV cache (CPU)")
    add("--max-num-seqs", type=int)
    add("--max-num-batched-tokens", type=int)
    add("--max-model-len", type=int)
    add("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    add("--device", choices=["auto", "cpu", "cuda"])
    add("--num-threads", type=int, help="torch threads on the CPU")
    add("--max-pull", type=int, help="most entries read at once")
    add("--max-attempts", type=int)
    add("--claim-min-idle-ms", type=int, help="lease length: idle time before a job is taken over")
    add("--chunk-tokens", type=int, help="coalesce: publish every k tokens")
    add("--chunk-interval-ms", type=float, help="coalesce: publish at least every t ms")
    add("--drain-timeout-s", type=float, help="how long running jobs may finish on SIGTERM")
    add("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    add("--engine-factory", help="'module:function' building the engine (tests, custom engines)")
    add("--chunk-trace-path", help="write per-chunk emit times here (benchmarks)")


def run_from_cli(args: argparse.Namespace) -> int:
    """Run a worker from parsed `add_worker_arguments` options until SIGTERM / SIGINT."""
    from worker.settings import WorkerSettings

    overrides = {
        flag: getattr(args, flag) for flag in _FLAGS if getattr(args, flag, None) is not None
    }
    settings = WorkerSettings(**overrides)
    tune_cpu_process(settings.device, settings.num_threads)
    return asyncio.run(serve(settings))


def tune_cpu_process(device: str, num_threads: int | None) -> None:
    """On the CPU, restart this process once with a caching allocator; pin OpenMP threads too
    when the worker uses every core (several workers sharing a host must not pin to the same
    cores). See engine.cpu_runtime."""
    from engine.cpu_runtime import no_gpu_visible, reexec_with_cpu_runtime

    if device == "cpu" or (device == "auto" and no_gpu_visible()):
        owns_cores = num_threads is None or num_threads >= (os.cpu_count() or 1)
        reexec_with_cpu_runtime(num_threads, bind_threads=owns_cores)


async def serve(settings: Any) -> int:
    """Load the engine, serve until SIGTERM / SIGINT, drain, hand back, return 0."""
    from worker.worker import Worker

    workers: list[Worker] = []

    def stop() -> None:
        for worker in workers:
            worker.request_stop()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop)  # a signal during the model load acts after it
    workers.append(Worker(settings))  # loads the model (blocking)
    await workers[0].run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    return run_from_cli(args)


if __name__ == "__main__":
    sys.exit(main())
