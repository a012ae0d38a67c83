"""Prefix caching on vs off: a shared-system-prompt workload through two in-process engines.

    python bench/engine/prefix_cache.py --num-prompts 32 --prefix-len 384 --suffix-len 32 --output-len 32

Every request is the same random 'system prompt' plus its own suffix (bench/common/workload.py's
shared_prefix_workload; greedy, ignore_eos). All requests arrive at once and are fed to an
`engine.Engine` step by step (bench/system/serve.py's run_engine), once with prefix caching on and
once off, alternating for --repeats rounds with a fresh system prompt each round (one untimed
request per round shows each engine the system prompt first, as earlier traffic would); medians of
TTFT and throughput, and the on/off ratios, are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.workload import (
    Request,
    add_engine_args,
    describe_runtime,
    make_engine,
    shared_prefix_series,
    tune_cpu_runtime,
)
from bench.system.serve import RunReport, arrival_times, run_engine, summarize


def median_report(reports: list[RunReport]) -> RunReport:
    """Field-wise median of several runs of one mode."""
    values = {}
    for f in fields(RunReport):
        column = [getattr(r, f.name) for r in reports]
        values[f.name] = column[0] if f.name == "mode" else statistics.median(column)
    return RunReport(**values)


def _one_run(engine, requests: list[Request], mode: str) -> tuple[RunReport, dict]:
    # In steady-state serving the system prompt was seen by earlier traffic; one untimed request
    # with it (on both engines alike) stands in for that. Without it a burst that fits in one
    # step would miss on every request and measure nothing but the hashing.
    run_engine(engine, [Request(requests[0].prompt_token_ids, 1)], [0.0])
    before = engine.stats()
    timelines, start = run_engine(engine, requests, arrival_times(len(requests), 0.0, 0))
    after = engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    counters = {
        "prompt_tokens_computed": after.num_prompt_tokens_computed
        - before.num_prompt_tokens_computed,
        "hit_rate": hits / queries if queries else 0.0,
    }
    return summarize(mode, 0.0, timelines, start), counters


def measure_prefix_cache(
    engine_on, engine_off, workload, repeats: int
) -> dict[str, dict | float | int]:
    """Alternate the two engines over `repeats` fresh workloads (workload(i) -> requests);
    returns per mode the median RunReport (as a dict) and cache counters, plus the ratios."""
    runs: dict[str, list[RunReport]] = {"on": [], "off": []}
    counters: dict[str, list[dict]] = {"on": [], "off": []}
    for repeat in range(repeats):
        requests = workload(repeat)
        order = ("on", "off") if repeat % 2 == 0 else ("off", "on")
        for mode in order:
            engine = engine_on if mode == "on" else engine_off
            report, counts = _one_run(engine, requests, f"prefix-{mode}")
            runs[mode].append(report)
            counters[mode].append(counts)
            print(
                f"  repeat {repeat} prefix caching {mode:3s}: {report.duration_s:.2f} s, "
                f"{report.output_token_throughput:.1f} out tok/s, TTFT p50 "
                f"{report.ttft_ms_p50:.0f} ms, hit rate {counts['hit_rate']:.2f}"
            )
    results: dict[str, dict | float | int] = {}
    for mode in ("on", "off"):
        results[mode] = asdict(median_report(runs[mode])) | {
            key: statistics.median(c[key] for c in counters[mode]) for key in counters[mode][0]
        }
    on, off = results["on"], results["off"]
    results["throughput_ratio"] = on["output_token_throughput"] / off["output_token_throughput"]
    results["ttft_p50_ratio"] = on["ttft_ms_p50"] / off["ttft_ms_p50"]
    results["requests"] = len(workload(0))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    tune_cpu_runtime(args.threads)
    engine_on = make_engine(args.model, args.dtype, args.seed, args.threads, True)
    engine_off = make_engine(args.model, args.dtype, args.seed, args.threads, False)
    workload = shared_prefix_series(vars(args), engine_on.runner.vocab_size, args.seed)

    print(f"# prefix cache bench: {describe_runtime()}")
    results = measure_prefix_cache(engine_on, engine_off, workload, args.repeats)
    print(
        f"prefix caching on/off: throughput ratio {results['throughput_ratio']:.2f}x, "
        f"TTFT p50 ratio {results['ttft_p50_ratio']:.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
