"""The benchmark report: every benchmark in one run, written as bench/results/report.md plus
PNG plots.

    python bench/suites/report.py --quick            # small sizes, a few minutes on a 2-core CPU
    python bench/suites/report.py                    # sizes for a real run (~20 min on 2 CPU cores)
    python bench/suites/report.py --readme README.md # also refresh README's benchmark table

Sections, each measured beside its baseline in this same run: offline throughput (inferq vs
transformers' generate; bench/engine/throughput.py), queue overhead (Redis + worker vs the engine
alone; bench/system/queue_overhead.py), serving latencies at several Poisson request rates through
Redis + API + worker vs the in-process engine at the same arrivals (bench/system/serve.py), and the
prefix cache on vs off on a shared-system-prompt workload (bench/engine/prefix_cache.py).

Only the block between the `bench-report` markers of report.md is rewritten; anything
hand-written around it (a GPU section, say) stays. The raw figures go to report.json. The
current figures of every machine are kept by hand in bench/RESULTS.md, the dated history in
bench/results/journal.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.machine import describe_machine, machine_one_liner
from bench.common.markdown_blocks import replace_block
from bench.common.workload import (
    make_engine,
    shared_prefix_series,
    tune_cpu_runtime,
    workload_series,
)
from schemas.defaults import DEFAULT_MODEL

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
REPORT_FILE = "report.md"
SECTIONS = ("offline", "queue", "serving", "prefix_cache")
REPORT_BLOCK = "bench-report"
README_BLOCK = "bench-summary"

# Workload sizes per preset. "full" suits a real run; "quick" verifies the whole pipeline in a
# few minutes on a small CPU; "tiny" is for the test suite (seconds, figures meaningless).
PRESETS: dict[str, dict[str, dict]] = {
    "full": {
        "offline": dict(num_prompts=64, input_len=128, output_len=64, range_ratio=0.5,
                        baseline_batch_sizes="16,all"),
        "queue": dict(num_prompts=32, input_len=128, output_len=64, range_ratio=0.5, repeats=3),
        "serving": dict(num_prompts=24, input_len=128, output_len=48, range_ratio=0.5,
                        rates="0.25,0.5,1,2"),
        "prefix_cache": dict(num_prompts=32, prefix_len=384, suffix_len=32, output_len=32,
                             repeats=2),
    },
    "quick": {
        "offline": dict(num_prompts=16, input_len=96, output_len=24, range_ratio=0.5,
                        baseline_batch_sizes="all"),
        "queue": dict(num_prompts=8, input_len=96, output_len=24, range_ratio=0.5, repeats=1),
        "serving": dict(num_prompts=8, input_len=96, output_len=24, range_ratio=0.5,
                        rates="0.5,1,2"),
        "prefix_cache": dict(num_prompts=12, prefix_len=256, suffix_len=16, output_len=16,
                             repeats=1),
    },
    "tiny": {
        "offline": dict(num_prompts=3, input_len=24, output_len=4, range_ratio=0.0,
                        baseline_batch_sizes="all"),
        "queue": dict(num_prompts=3, input_len=24, output_len=4, range_ratio=0.0, repeats=1),
        "serving": dict(num_prompts=3, input_len=24, output_len=4, range_ratio=0.0,
                        rates="4,16"),
        "prefix_cache": dict(num_prompts=3, prefix_len=48, suffix_len=8, output_len=3,
                             repeats=1),
    },
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    size.add_argument("--tiny", action="store_true", help="seconds; for tests, figures are noise")
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help=f"folder for {REPORT_FILE} etc."
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma list of sections")
    parser.add_argument("--rates", default=None, help="serving request rates, e.g. 0.5,1,2")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default all)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--note", default=None, help="a line under the machine table (e.g. what else was running)"
    )
    parser.add_argument(
        "--readme", type=Path, default=None, help="also refresh this README's benchmark table"
    )
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


def preset_name(args: argparse.Namespace) -> str:
    return "tiny" if args.tiny else "quick" if args.quick else "full"


# ------------------------------------------------------------------ the sections


def run_offline(llm, sizes: dict, seed: int) -> dict:
    from bench.engine.throughput import load_hf, measure_inferq, measure_transformers

    requests = workload_series(sizes, llm.engine.runner.vocab_size, seed)(0)
    results = {"ours": measure_inferq(llm, requests)}
    hf_model = load_hf(llm.engine.model_path, llm.engine.runner.dtype)
    best = measure_transformers(hf_model, requests, sizes["baseline_batch_sizes"].split(","))
    del hf_model
    results["transformers_best"] = best
    results["throughput_ratio"] = results["ours"]["output_tok_s"] / best["output_tok_s"]
    return results


def run_queue(llm, args: argparse.Namespace, sizes: dict) -> dict:
    from bench.system.queue_overhead import WorkerOptions, measure_queue_overhead

    # seed offsets keep each section's prompts apart from the others'
    workload = workload_series(sizes, llm.engine.runner.vocab_size, args.seed + 1000)
    options = WorkerOptions(model=args.model, dtype=args.dtype, threads=args.threads)
    return measure_queue_overhead(llm, options, workload, sizes["repeats"])


def run_serving(llm, args: argparse.Namespace, sizes: dict) -> list[dict]:
    from bench.system.serve import measure_serving, print_table

    rates = [float(r) for r in (args.rates or sizes["rates"]).split(",") if r.strip()]
    workload = workload_series(sizes, llm.engine.runner.vocab_size, args.seed + 2000, 104729)
    flags = ["--dtype", args.dtype] + (["--num-threads", str(args.threads)] if args.threads else [])
    reports = measure_serving(llm.engine, args.model, workload, rates, args.seed, flags)
    print_table(reports)
    return [asdict(r) for r in reports]


def run_prefix_cache(llm, args: argparse.Namespace, sizes: dict) -> dict:
    from bench.engine.prefix_cache import measure_prefix_cache

    engine_off = make_engine(args.model, args.dtype, args.seed, args.threads, False)
    workload = shared_prefix_series(sizes, llm.engine.runner.vocab_size, args.seed + 3000)
    results = measure_prefix_cache(llm.engine, engine_off, workload, sizes["repeats"])
    del engine_off
    return results


# ------------------------------------------------------------------ writing


def write_plots(data: dict, out: Path) -> list[Path]:
    from bench.suites import plots

    written = []
    if data.get("offline") or data.get("queue"):
        written.append(
            plots.plot_offline(
                data.get("offline"), data.get("queue"), out / "offline_throughput.png"
            )
        )
    if data.get("serving"):
        sizes = data["sizes"]["serving"]
        written.append(
            plots.plot_serving_throughput(
                data["serving"], out / "serving_throughput.png", sizes["output_len"]
            )
        )
        written.append(plots.plot_serving_latency(data["serving"], out / "serving_latency.png"))
    if data.get("prefix_cache"):
        written.append(plots.plot_prefix_cache(data["prefix_cache"], out / "prefix_cache.png"))
    return written


REPORT_INTRO = """# inferq benchmark report

The block below is generated by `bench/suites/report.py` (rerun it to refresh; edits inside the
markers are overwritten). Hand-written sections (GPU runs, notes) go outside the markers. The
current figures of every machine are in [../RESULTS.md](../RESULTS.md).
"""


def write_results(data: dict, out: Path) -> Path:
    from bench.suites.results_md import render_report

    path = out / REPORT_FILE
    text = path.read_text() if path.exists() else REPORT_INTRO
    path.write_text(replace_block(text, REPORT_BLOCK, render_report(data)))
    return path


def write_readme_summary(data: dict, readme: Path) -> None:
    from bench.common.gpu_report import markdown_table
    from bench.suites.results_md import HEADLINE_HEADERS, headline_rows

    block = (
        f"Measured by `python bench/suites/report.py {data['command_flags']}` on {data['date']}: "
        f"{machine_one_liner(data['machine'])}. Each ratio is against the baseline measured in "
        "the same run; details, workloads and plots in "
        f"[bench/results/{REPORT_FILE}](bench/results/{REPORT_FILE}).\n\n"
        + markdown_table(HEADLINE_HEADERS, headline_rows(data))
    )
    readme.write_text(replace_block(readme.read_text(), README_BLOCK, block))


# ------------------------------------------------------------------ main


def _flags_without_out(argv: list[str]) -> list[str]:
    """The command line as the report quotes it: --out names a local folder, not a setting,
    and --note is printed under the machine table already."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--note"):
            skip = True
        elif not arg.startswith(("--out=", "--note=")):
            shown.append(arg)
    return shown


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tune_cpu_runtime(args.threads)
    from bench.engine.throughput import warm_up
    from engine import LLM

    preset = PRESETS[preset_name(args)]
    sections = [s for s in SECTIONS if s in args.only.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    shown = _flags_without_out(argv if argv is not None else sys.argv[1:])
    data: dict = {
        "machine": describe_machine(),
        "machine_note": args.note,
        "date": datetime.date.today().isoformat(),
        "command_flags": shlex.join(shown),
        "sizes": {s: preset[s] for s in sections},
        "model": args.model,
    }
    if "serving" in sections and args.rates:
        data["sizes"]["serving"] = preset["serving"] | {"rates": args.rates}
    print(f"# report: sections {sections}; {machine_one_liner(data['machine'])}", flush=True)

    llm = LLM(args.model, dtype=args.dtype, seed=args.seed, num_threads=args.threads)
    warm_up(llm, args.seed)
    runners = {
        "offline": lambda: run_offline(llm, preset["offline"], args.seed),
        "queue": lambda: run_queue(llm, args, preset["queue"]),
        "serving": lambda: run_serving(llm, args, data["sizes"]["serving"]),
        "prefix_cache": lambda: run_prefix_cache(llm, args, preset["prefix_cache"]),
    }
    for section in sections:
        section_started = time.perf_counter()
        print(f"# --- {section}", flush=True)
        data[section] = runners[section]()
        print(f"# {section} took {time.perf_counter() - section_started:.0f} s", flush=True)
    data["duration_s"] = time.perf_counter() - started

    (args.out / "report.json").write_text(json.dumps(data, indent=2))
    written = [*write_plots(data, args.out), write_results(data, args.out)]
    if args.readme:
        write_readme_summary(data, args.readme)
        written.append(args.readme)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
