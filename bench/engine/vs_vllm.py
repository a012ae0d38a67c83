"""inferq against vLLM's CPU build: the same workload, the same model folder, in one run.

    python bench/engine/vs_vllm.py --vllm-python /path/to/vllm-venv/bin/python --dtype float32
    inferq bench vs-vllm --vllm-python /path/to/vllm-venv/bin/python --dtype bfloat16

Workload: 64 requests of random token prompts (32-256 tokens) and outputs (16-128 tokens),
greedy, ignore_eos, prefix caching off on both. Single stream: one 128-token prompt, 256 new
tokens; decode ms/token = (full generate - time to first token) / 255, TTFT measured as a
one-token generate the same way on both sides.

Each system runs in a process of its own (bench/engine/peers/*_run.py) that loads the model once,
warms up untimed, then runs `--rounds` rounds on command; the rounds alternate between the
systems (inferq, vLLM, inferq, vLLM, ...) and the figures are medians over rounds. inferq runs
under its tuned CPU runtime (engine/platforms/cpu/runtime.py); vLLM under the tuning its CPU docs give
(VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND over every usable core, tcmalloc and the
venv's libiomp5 preloaded), from a separate venv whose python `--vllm-python` names (see
shared/peers/vllm-cpu/ for its install script); without one, vLLM is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.figures import median_rates
from bench.common.machine import describe_machine, machine_one_liner, usable_cores
from bench.common.workload import Request, ranged_workload, workload_line
from bench.engine.peers.peer_process import Peer, run_rounds
from engine.model_files import resolve_model_path
from engine.platforms.cpu.runtime import cpu_runtime_env
from schemas.defaults import DEFAULT_MODEL

PEERS = Path(__file__).resolve().parent / "peers"
MAX_MODEL_LEN = 1024  # as vLLM's CPU docs run it; also given to inferq
KV_CACHE_GIB = 4  # VLLM_CPU_KVCACHE_SPACE; inferq gets the same KV-cache memory
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
VLLM_INSTALL_HINT = "build one with shared/peers/vllm-cpu/install.sh VENV and pass VENV/bin/python"
FIGURES = ("output_tok_s", "total_tok_s", "decode_ms_per_token", "ttft_ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name or HF folder")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "auto"],
        help="both sides; auto: each side's own default",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="python of a venv holding vLLM's CPU build; absent: vLLM is skipped",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-range", type=_int_range, default=(32, 256), help="LOW-HIGH")
    parser.add_argument("--output-range", type=_int_range, default=(16, 128), help="LOW-HIGH")
    parser.add_argument("--decode-prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds per system")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="cores for each side (default: all usable)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="keep the peers' logs here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    for name in ("num_requests", "rounds", "decode_prompt_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2")
    return args


def _int_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def model_limits(folder: Path) -> tuple[int, int]:
    """(vocab size, context length) from the folder's config.json, read without transformers."""
    config = json.loads((folder / "config.json").read_text())
    return config["vocab_size"], config.get("max_position_embeddings", MAX_MODEL_LEN)


def build_job(args: argparse.Namespace, folder: Path) -> tuple[dict[str, Any], list[Request]]:
    """The job every peer receives: model folder, dtype, token prompts and output lengths."""
    vocab_size, context = model_limits(folder)
    requests = ranged_workload(
        args.num_requests, args.input_range, args.output_range, vocab_size, args.seed
    )
    decode = ranged_workload(
        1, (args.decode_prompt_len,) * 2, (args.decode_tokens,) * 2, vocab_size, args.seed + 1
    )[0]
    job = {
        "model": str(folder),
        "dtype": args.dtype,
        "threads": args.threads or usable_cores(),
        "max_model_len": min(MAX_MODEL_LEN, context),
        "kv_cache_gib": KV_CACHE_GIB,
        "prompts": [r.prompt_token_ids for r in requests],
        "output_lens": [r.output_len for r in requests],
        "decode_prompt": decode.prompt_token_ids,
        "decode_tokens": args.decode_tokens,
    }
    return job, requests


def inferq_env(threads: int) -> dict[str, str]:
    """inferq's tuned CPU runtime (allocator, threads bound to cores), as its launcher sets it."""
    return cpu_runtime_env(threads, bind_threads=True)


def vllm_env(python: Path, threads: int) -> dict[str, str]:
    """The environment vLLM's CPU docs give it: KV-cache space, its compute threads bound to
    the cores this bench may use, tcmalloc and the venv's Intel OpenMP preloaded. The project's
    own settings stay out (PYTHONPATH would put inferq's packages beside vLLM's)."""
    venv = python.parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(KV_CACHE_GIB)
    env["VLLM_CPU_OMP_THREADS_BIND"] = core_list(threads)
    preload = (TCMALLOC, str(venv / "lib" / "libiomp5.so"))
    env["LD_PRELOAD"] = ":".join(p for p in preload if Path(p).exists())
    return env


def core_list(threads: int) -> str:
    """The first `threads` cores this process may run on, as ranges: '0-1', '0-3,8-11'."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    spans: list[list[int]] = []
    for core in cores:
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def make_peers(
    args: argparse.Namespace, job_path: Path, threads: int, log_dir: Path
) -> tuple[list[Peer], str | None]:
    """The systems to run, and why vLLM is skipped (None when it runs)."""
    peers = [
        Peer(
            "inferq",
            [sys.executable, str(PEERS / "inferq_run.py"), str(job_path)],
            inferq_env(threads),
            log_dir / "inferq.log",
        )
    ]
    python: Path | None = args.vllm_python
    if python is None:
        return peers, f"no --vllm-python given; {VLLM_INSTALL_HINT}"
    if not (python.is_file() and os.access(python, os.X_OK)):
        return peers, f"--vllm-python {python} is not an executable file; {VLLM_INSTALL_HINT}"
    peers.append(
        Peer(
            "vllm",
            [str(python), str(PEERS / "vllm_run.py"), str(job_path)],
            vllm_env(python, threads),
            log_dir / "vllm.log",
        )
    )
    return peers, None


def summarize(peers: list[Peer]) -> dict[str, dict[str, Any]]:
    return {
        peer.name: {"info": peer.info, "runs": peer.runs, "median": median_rates(peer.runs)}
        for peer in peers
        if peer.runs
    }


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float] | None:
    """inferq / vLLM for each figure (throughput: above 1 inferq is faster; ms/token: below)."""
    if "inferq" not in systems or "vllm" not in systems:
        return None
    ours, theirs = systems["inferq"]["median"], systems["vllm"]["median"]
    return {key: ours[key] / theirs[key] for key in FIGURES}


def print_report(
    systems: dict[str, dict[str, Any]], ratio: dict[str, float] | None, rounds: int
) -> None:
    labels = {"inferq": "inferq", "vllm": "vLLM (CPU build)"}
    print(f"{'system':18s} {'dtype':9s} {'output tok/s':>12s} {'total tok/s':>12s} "
          f"{'decode ms/tok':>13s} {'TTFT ms':>8s}")  # fmt: skip
    for name, system in systems.items():
        m, info = system["median"], system["info"]
        print(
            f"{labels[name]:18s} {info['dtype']:9s} {m['output_tok_s']:12.1f} "
            f"{m['total_tok_s']:12.1f} {m['decode_ms_per_token']:13.2f} {m['ttft_ms']:8.1f}"
        )
    if ratio is not None:
        print(
            f"{'inferq / vLLM':18s} {'':9s} {ratio['output_tok_s']:11.2f}x "
            f"{ratio['total_tok_s']:11.2f}x {ratio['decode_ms_per_token']:12.2f}x "
            f"{ratio['ttft_ms']:7.2f}x"
        )
        print("(throughput ratios above 1 and ms ratios below 1: inferq is faster)")
    print(f"# medians over {rounds} round(s) per system, rounds alternating between systems")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    folder = resolve_model_path(args.model)
    job, requests = build_job(args, folder)
    threads: int = job["threads"]
    machine = describe_machine()
    print(f"# machine: {machine_one_liner(machine)}")
    print(f"# model: {folder} (dtype requested: {args.dtype})")
    print(
        f"{workload_line(requests)} (prompts {args.input_range[0]}-{args.input_range[1]}, outputs "
        f"{args.output_range[0]}-{args.output_range[1]}, greedy, ignore_eos, no prefix caching); "
        f"single stream {args.decode_prompt_len} in, {args.decode_tokens} out"
    )
    with tempfile.TemporaryDirectory(prefix="vs_vllm-") as scratch:
        log_dir = args.log_dir or Path(scratch)
        log_dir.mkdir(parents=True, exist_ok=True)
        job_path = Path(scratch) / "job.json"
        job_path.write_text(json.dumps(job))
        peers, skipped = make_peers(args, job_path, threads, log_dir)
        if skipped:
            print(f"# vLLM skipped: {skipped}")
        failures = run_rounds(peers, args.rounds)
    for name, message in failures.items():
        print(f"# {name} failed: {message}")
    systems = summarize(peers)
    for system in systems.values():
        info = system["info"]
        described = ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("system", "load_s"))
        print(f"# {info['system']}: {described}, load {info['load_s']:.1f} s")
    print_report(systems, ratio := ratios(systems), args.rounds)
    if args.json:
        results = {
            "machine": machine,
            "model": str(folder),
            "dtype": args.dtype,
            "workload": {
                "num_requests": args.num_requests,
                "input_range": args.input_range,
                "output_range": args.output_range,
                "decode_prompt_len": args.decode_prompt_len,
                "decode_tokens": args.decode_tokens,
                "seed": args.seed,
            },
            "rounds": args.rounds,
            "systems": systems,
            "vllm_skipped": skipped,
            "failures": failures,
            "ratios": ratio,
        }
        args.json.write_text(json.dumps(results, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
