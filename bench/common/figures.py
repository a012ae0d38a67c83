"""Arithmetic every benchmark shares: token rates, medians over repeats, quantiles, one table row."""

from __future__ import annotations

import statistics


def rates(seconds: float, prompt_tokens: int, output_tokens: int) -> dict:
    """Seconds and token throughputs of one timed run."""
    return {
        "seconds": seconds,
        "output_tok_s": output_tokens / seconds,
        "total_tok_s": (prompt_tokens + output_tokens) / seconds,
    }


def median_rates(runs: list[dict]) -> dict:
    """Key-wise median over repeats of `rates()` dicts (we quote medians, never best runs)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def quantile(ordered: list[float], q: float) -> float:
    """Nearest-rank quantile of an already sorted list (NaN when empty)."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def print_row(label: str, run: dict, width: int = 40) -> None:
    print(
        f"{label:{width}s} {run['seconds']:8.2f} s  output {run['output_tok_s']:8.1f} tok/s  "
        f"total {run['total_tok_s']:8.1f} tok/s"
    )
