"""The measuring half of a peer process, shared by every system bench/engine/vs_vllm.py compares.

Standard library only: it runs inside other systems' virtual environments. A peer script loads
its system, wraps it as a `Generate` and calls `serve`; every side is then timed by this same
code. The parent talks to it in lines: it writes `round` (or `quit`) on stdin and reads the
answer from the stdout line that starts with MARKER (everything else there is the system's own
logging, which the parent keeps in a log file).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER = "@@peer "

# (prompt token ids, max_tokens of each) -> output tokens produced; greedy, ignore_eos
Generate = Callable[[list[list[int]], list[int]], int]

TTFT_REPEATS = 3
FULL_REPEATS = 2


def read_job(argv: list[str]) -> dict[str, Any]:
    """The job file the parent wrote (its path is the one argument)."""
    if len(argv) != 2:
        raise SystemExit(f"usage: {argv[0]} JOB.json")
    return json.loads(Path(argv[1]).read_text())


def emit(kind: str, payload: dict[str, Any]) -> None:
    sys.stdout.write(MARKER + json.dumps({"kind": kind, **payload}) + "\n")
    sys.stdout.flush()


def serve(job: dict[str, Any], generate: Generate, info: dict[str, Any]) -> None:
    """Warm up untimed, say `ready` with `info`, then answer each `round` until `quit`/EOF."""
    prompts: list[list[int]] = job["prompts"]
    output_lens: list[int] = job["output_lens"]
    decode_prompt: list[int] = job["decode_prompt"]
    started = time.perf_counter()
    # one-time costs (allocations, compilation, lazy init) stay out of every timed run
    generate(prompts[:8], [min(8, n) for n in output_lens[:8]])
    generate([decode_prompt], [4])
    emit("ready", {"info": info, "warmup_s": time.perf_counter() - started})
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "round":
            emit("error", {"message": f"unknown command {command!r}"})
            continue
        emit("round", measure_round(job, generate))


def measure_round(job: dict[str, Any], generate: Generate) -> dict[str, float]:
    """The whole workload timed once, then the single stream: decode ms/token is
    (time of the full generate - time to first token) / (tokens - 1), TTFT measured as a
    generate of one token."""
    prompts: list[list[int]] = job["prompts"]
    output_lens: list[int] = job["output_lens"]
    seconds = _timed(generate, prompts, output_lens)
    decode_prompt: list[int] = job["decode_prompt"]
    decode_tokens: int = job["decode_tokens"]
    ttft = statistics.median(_timed(generate, [decode_prompt], [1]) for _ in range(TTFT_REPEATS))
    full = statistics.median(
        _timed(generate, [decode_prompt], [decode_tokens]) for _ in range(FULL_REPEATS)
    )
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(output_lens)
    return {
        "seconds": seconds,
        "output_tok_s": output_tokens / seconds,
        "total_tok_s": (prompt_tokens + output_tokens) / seconds,
        "ttft_ms": ttft * 1000,
        "decode_ms_per_token": (full - ttft) / (decode_tokens - 1) * 1000,
    }


def _timed(generate: Generate, prompts: list[list[int]], output_lens: list[int]) -> float:
    started = time.perf_counter()
    produced = generate(prompts, output_lens)
    seconds = time.perf_counter() - started
    if produced != sum(output_lens):
        raise RuntimeError(f"produced {produced} output tokens, asked for {sum(output_lens)}")
    return seconds
