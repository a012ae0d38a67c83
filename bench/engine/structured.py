"""Structured-output overhead: the mixed workload with and without a JSON schema constraint on
every request, alternated round by round in one run (so both see the same machine state).

Every request produces exactly its output length (ignore_eos), so both runs decode the same
number of tokens and the difference is the cost of the grammar: compiling it (once, cached),
the per-step token masks, and advancing each matcher. Medians over --rounds are quoted.

    python bench/engine/structured.py --num-prompts 32 --input-len 160 --output-len 72 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.figures import median_rates, print_row, rates
from bench.common.workload import (
    Request,
    add_workload_args,
    load_llm,
    token_counts,
    tune_cpu_runtime,
    workload_line,
    workload_series,
)

# A record a backend might ask for: bounded numbers, an enum, an array, free text.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "label": {"enum": ["spam", "ham", "unsure"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "notes": {"type": "string"},
    },
    "required": ["id", "label", "score", "tags", "notes"],
    "additionalProperties": False,
}


def params(output_len: int, constrained: bool):
    from engine import SamplingParams
    from schemas.structured import StructuredOutput

    return SamplingParams(
        temperature=0.0,
        max_tokens=output_len,
        ignore_eos=True,
        structured_output=StructuredOutput(json_schema=SCHEMA) if constrained else None,
    )


def timed_run(llm, requests: list[Request], constrained: bool) -> dict:
    started = time.perf_counter()
    outputs = llm.generate(
        [r.prompt_token_ids for r in requests],
        [params(r.output_len, constrained) for r in requests],
        use_tqdm=False,
    )
    seconds = time.perf_counter() - started
    prompt_tokens, output_tokens = token_counts(requests)
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == output_tokens
    return rates(seconds, prompt_tokens, output_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    runtime = tune_cpu_runtime(args.threads)
    llm = load_llm(args)
    requests = workload_series(vars(args), llm.engine.runner.vocab_size, args.seed)(0)
    print(workload_line(requests))
    print(f"# runtime: {runtime}")
    timed_run(llm, requests[:4], constrained=True)  # warm-up, untimed
    runs: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
    for round_index in range(args.rounds):
        order = [False, True] if round_index % 2 == 0 else [True, False]  # neither always first
        for constrained in order:
            name = "json_schema" if constrained else "unconstrained"
            runs[name].append(timed_run(llm, requests, constrained))
    results = {name: median_rates(rounds) for name, rounds in runs.items()}
    for name, figures in results.items():
        print_row(f"{name} (median of {args.rounds})", figures)
    ratio = results["json_schema"]["output_tok_s"] / results["unconstrained"]["output_tok_s"]
    results["ratio"] = {"constrained_over_unconstrained": ratio}
    print(f"constrained / unconstrained output throughput: {ratio:.3f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
