"""Quantized weights against full precision, same run, same machine.

    python bench/engine/quantization.py --json quant.json
    inferq bench quantization --variants none int8 int4 gguf --rounds 2

For each variant (full precision "none", int8, w8a8, int4, fp8, gguf): single-stream decode
ms/token (128 prompt tokens, 128 new), mixed-workload throughput (64 requests, 32-256 prompt
tokens, 16-128 output, greedy, ignore_eos), weight bytes, peak RSS, and perplexity on the tests'
text (the opening of Coriolanus). Each variant runs in a child process of its own, so its peak
RSS is its own (it includes the 1 GiB KV cache); the rounds alternate between variants and
figures are medians over rounds. Ratios are against the full-precision variant of the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.figures import rates
from bench.common.machine import describe_machine, machine_one_liner
from bench.common.workload import ranged_workload, token_counts, tune_cpu_runtime, workload_line
from bench.engine.throughput import engine_decode_ms, timed_generate, warm_up
from schemas.defaults import DEFAULT_MODEL

TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "coriolanus_act1.txt"
VARIANTS = ("none", "int8", "w8a8", "int4", "fp8", "gguf")
COLUMNS = (
    ("decode_ms_per_token", "decode ms/tok"),
    ("output_tok_s", "output tok/s"),
    ("weight_mib", "weights MiB"),
    ("peak_rss_mib", "peak RSS MiB"),
    ("perplexity", "perplexity"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        args.out.write_text(json.dumps(measure_variant(args, args.child)))
        return
    runs: dict[str, list[dict]] = {variant: [] for variant in args.variants}
    for round_index in range(args.rounds):
        for variant in args.variants:
            runs[variant].append(run_child(args, variant))
            print(f"# round {round_index + 1} {variant}: {one_line(runs[variant][-1])}", flush=True)
    figures = {variant: medians(samples) for variant, samples in runs.items()}
    machine = describe_machine()
    print(f"# machine: {machine_one_liner(machine)}")
    print(f"# {next(iter(runs.values()))[0]['runtime']}")
    print(f"{figures[args.variants[0]]['workload']}; single stream 128 in, 128 out")
    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "variants": figures}, indent=1))


def run_child(args: argparse.Namespace, variant: str) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "figures.json"
        command = [sys.executable, __file__, "--child", variant, "--out", str(out)]
        for flag in ("model", "dtype", "num_prompts", "threads", "seed"):
            value = getattr(args, flag)
            if value is not None:
                command += [f"--{flag.replace('_', '-')}", str(value)]
        subprocess.run(command, check=True)
        return json.loads(out.read_text())


def measure_variant(args: argparse.Namespace, variant: str) -> dict:
    """One variant in this process: load, warm up, then every figure."""
    runtime = tune_cpu_runtime(args.threads)
    from engine import LLM

    started = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=None if variant == "none" else variant,
        enable_prefix_caching=False,
        num_threads=args.threads,
    )
    load_s = time.perf_counter() - started
    warm_up(llm, args.seed)
    vocab = llm.engine.runner.vocab_size
    single = ranged_workload(1, (128, 128), (128, 128), vocab, args.seed + 7)[0]
    decode_ms = engine_decode_ms(llm, single.prompt_token_ids, 128)
    requests = ranged_workload(args.num_prompts, (32, 256), (16, 128), vocab, args.seed)
    seconds, _ = timed_generate(llm, requests)
    prompt_tokens, output_tokens = token_counts(requests)
    # Serving's peak, before the perplexity's one long prefill adds its activations.
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "variant": variant,
        "quantization": llm.engine.quantization,
        "load_s": load_s,
        "decode_ms_per_token": decode_ms,
        **rates(seconds, prompt_tokens, output_tokens),
        "weight_mib": llm.engine.weight_bytes / 2**20,
        "peak_rss_mib": peak_rss_mib,
        "perplexity": llm.perplexity(TEXT.read_text()),
        "workload": workload_line(requests),
        "runtime": runtime,
    }


def medians(samples: list[dict]) -> dict:
    numeric = {k for k, v in samples[0].items() if isinstance(v, int | float)}
    return {
        key: statistics.median(s[key] for s in samples) if key in numeric else samples[0][key]
        for key in samples[0]
    }


def one_line(run: dict) -> str:
    return ", ".join(f"{label} {run[key]:.2f}" for key, label in COLUMNS)


def print_table(figures: dict[str, dict]) -> None:
    print(f"{'variant':<8}" + "".join(f"{label:>15}" for _, label in COLUMNS))
    for variant, run in figures.items():
        print(f"{variant:<8}" + "".join(f"{run[key]:>15.2f}" for key, _ in COLUMNS))
    base = figures.get("none")
    if base is None:
        return
    print("ratios against full precision (decode: fp32 ms / variant ms, i.e. speed-up):")
    for variant, run in figures.items():
        if variant == "none":
            continue
        print(
            f"{variant:<8} decode {base['decode_ms_per_token'] / run['decode_ms_per_token']:.2f}x"
            f"  throughput {run['output_tok_s'] / base['output_tok_s']:.2f}x"
            f"  weights {run['weight_mib'] / base['weight_mib']:.2f}x"
            f"  perplexity {run['perplexity'] / base['perplexity'] - 1:+.2%}"
        )


if __name__ == "__main__":
    main()
