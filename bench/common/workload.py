"""Shared pieces of the benchmarks: vLLM-style random workloads, a tuned CPU launcher, and the
Redis server and children a benchmark starts (through cli.up, as `inferq up` does)."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.platforms.cpu.runtime import describe_cpu_runtime, reexec_with_cpu_runtime
from schemas.defaults import DEFAULT_MODEL

if TYPE_CHECKING:
    from cli.up_system import System
    from engine import LLM


@dataclass
class Request:
    prompt_token_ids: list[int]
    output_len: int


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """--model, --seed, --threads and --dtype: the engine a benchmark measures."""
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all cores)"
    )
    parser.add_argument("--dtype", default="auto")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=160)
    parser.add_argument("--output-len", type=int, default=72)
    parser.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±r)"
    )


def random_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
) -> list[Request]:
    """Random token prompts and output lengths, uniform in [len*(1-r), len*(1+r)] like vLLM's."""

    def bounds(mean: int) -> tuple[int, int]:
        return max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))

    return ranged_workload(num_prompts, bounds(input_len), bounds(output_len), vocab_size, seed)


def ranged_workload(
    num_prompts: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[Request]:
    """Random token prompts and output lengths, each uniform in its inclusive (low, high)."""
    rng = random.Random(seed)
    special = 256  # skip low ids, where byte-level vocabularies keep control/special tokens
    return [
        Request(
            [rng.randrange(special, vocab_size) for _ in range(rng.randint(*input_range))],
            rng.randint(*output_range),
        )
        for _ in range(num_prompts)
    ]


def tune_cpu_runtime(threads: int | None) -> str:
    """Re-exec once with a caching allocator preloaded and OpenMP threads pinned to cores (a
    benchmark owns the machine; INFERQ_CPU_TUNE=0 runs untuned), then give torch `threads`
    (default: all). Returns a line naming torch, its threads and the runtime."""
    reexec_with_cpu_runtime(threads or os.cpu_count(), bind_threads=True)
    import torch

    if threads:
        torch.set_num_threads(threads)
    return f"torch {torch.__version__}, threads={torch.get_num_threads()}, {describe_runtime()}"


def describe_runtime() -> str:
    return describe_cpu_runtime()


def load_llm(args: argparse.Namespace, **engine_args: Any) -> LLM:
    """The engine a benchmark measures: --model, --dtype, --seed and --threads, plus the
    scheduler limits --max-num-seqs / --max-num-batched-tokens where given."""
    from engine import LLM

    limits = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    given = {name: value for name, value in limits.items() if value}
    return LLM(
        args.model,
        num_threads=args.threads,
        dtype=args.dtype,
        seed=args.seed,
        **given,
        **engine_args,
    )


def token_counts(requests: list[Request]) -> tuple[int, int]:
    """(prompt tokens, output tokens) of a workload."""
    return sum(len(r.prompt_token_ids) for r in requests), sum(r.output_len for r in requests)


def make_engine(model: str, dtype: str, seed: int, threads: int | None, prefix_caching: bool):
    from engine import Engine, EngineConfig

    config = EngineConfig(
        model=model,
        dtype=dtype,
        seed=seed,
        num_threads=threads,
        enable_prefix_caching=prefix_caching,
    )
    return Engine(config)


def workload_line(requests: list[Request]) -> str:
    prompt_tokens, output_tokens = token_counts(requests)
    return f"# workload: {len(requests)} prompts, {prompt_tokens} prompt + {output_tokens} output tokens"


def shared_prefix_workload(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
) -> list[Request]:
    """One random 'system prompt' of prefix_len tokens shared by every request, each followed
    by its own random suffix_len tokens: the workload a prefix cache exists for."""
    rng = random.Random(seed)
    special = 256  # as in random_workload
    prefix = [rng.randrange(special, vocab_size) for _ in range(prefix_len)]
    return [
        Request(
            prefix + [rng.randrange(special, vocab_size) for _ in range(suffix_len)], output_len
        )
        for _ in range(num_prompts)
    ]


def workload_series(
    sizes: Mapping[str, Any], vocab_size: int, seed: int, stride: int = 7919
) -> Callable[[int], list[Request]]:
    """round -> a fresh random_workload of `sizes` (num_prompts, input_len, output_len,
    range_ratio): same sizes every round, new tokens, so no round finds the one before it in
    the prefix cache."""

    def make(round_index: int) -> list[Request]:
        return random_workload(
            sizes["num_prompts"],
            sizes["input_len"],
            sizes["output_len"],
            sizes["range_ratio"],
            vocab_size,
            seed + stride * round_index,
        )

    return make


def shared_prefix_series(
    sizes: Mapping[str, Any], vocab_size: int, seed: int
) -> Callable[[int], list[Request]]:
    """round -> a shared_prefix_workload of `sizes` (num_prompts, prefix_len, suffix_len,
    output_len) with a fresh system prompt each round."""

    def make(round_index: int) -> list[Request]:
        return shared_prefix_workload(
            sizes["num_prompts"],
            sizes["prefix_len"],
            sizes["suffix_len"],
            sizes["output_len"],
            vocab_size,
            seed + 15485863 * (round_index + 1),
        )

    return make


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Children started inside get every core: a tuned benchmark process (tune_cpu_runtime) has
    its main thread pinned to one core, and children inherit that mask."""
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


@contextlib.contextmanager
def bench_redis(data_dir: Path) -> Iterator[tuple[System, str]]:
    """A fresh redis-server on a free port with its data in `data_dir`, and the cli.up System
    it runs in: children spawned on it stop with it, newest first, when the block ends."""
    from cli.up_redis import start_redis
    from cli.up_system import System

    system = System()
    try:
        redis_url = f"redis://127.0.0.1:{free_port()}/0"
        with unpinned():
            start_redis(system, redis_url, data_dir)
        yield system, redis_url
    finally:
        system.stop()
