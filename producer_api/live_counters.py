"""Prometheus counters and histograms built from the live-stats samples workers write to Redis
(`schemas.workers`): the samples are a sliding window, Prometheus wants series that only grow,
so each API process folds every sample into its own cumulative totals once.

- `TokenCounters`: prompt and generated tokens per model, from each worker's cumulative counts
  (a worker that restarts counts from zero again; one first seen counts all it did).
- `LatencyHistograms`: TTFT, inter-token and end-to-end latency per model and priority class,
  with vLLM's bucket bounds so a vLLM dashboard's quantiles read the same.
- `NewSamples`: which latency samples were folded in already, so re-reading an overlapping
  window never counts a job twice.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from schemas.workers import LIVE_STATS_WINDOW_S, TokenSample, TtftSample

log = logging.getLogger(__name__)

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# A sample may reach Redis this long after its job finished (it waits for the worker's next
# heartbeat, longer while Redis was away) and still be counted.
LATE_SAMPLE_S = 60.0


class CumulativeHistogram:
    """A Prometheus histogram that takes weighted observations (a job's mean inter-token latency
    stands for each of its token gaps)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self._counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self._counts)

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs ending with +Inf, as the exposition format wants."""
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self._counts, strict=True):
            total += count
            out.append((floatToGoString(bound), float(total)))
        return out


@dataclass
class LatencyHistograms:
    """The latency histograms of one model and priority class."""

    ttft: CumulativeHistogram = field(default_factory=lambda: CumulativeHistogram(TTFT_BUCKETS))
    itl: CumulativeHistogram = field(default_factory=lambda: CumulativeHistogram(ITL_BUCKETS))
    e2e: CumulativeHistogram = field(default_factory=lambda: CumulativeHistogram(E2E_BUCKETS))

    def observe(self, sample: TtftSample) -> None:
        self.ttft.observe(sample.ttft_s)
        if sample.e2e_s is not None:
            self.e2e.observe(sample.e2e_s)
        if sample.itl_s is not None and sample.output_tokens > 1:
            self.itl.observe(sample.itl_s, sample.output_tokens - 1)


class TokenCounters:
    """Prompt and generated tokens per model over every worker seen, from the cumulative counts
    in their heartbeat samples."""

    def __init__(self) -> None:
        self.prompt: dict[str, int] = defaultdict(int)
        self.generated: dict[str, int] = defaultdict(int)
        self._last: dict[tuple[str, str], TokenSample] = {}

    def add(self, model: str, samples: Iterable[TokenSample]) -> None:
        for sample in sorted(samples, key=lambda s: s.at):
            key = (model, sample.worker)
            last = self._last.get(key)
            if last is not None and sample.at <= last.at:
                continue  # counted already
            self.prompt[model] += _growth(last.prompt_tokens if last else 0, sample.prompt_tokens)
            self.generated[model] += _growth(
                last.generated_tokens if last else 0, sample.generated_tokens
            )
            self._last[key] = sample
        self._forget_gone_workers()

    def _forget_gone_workers(self) -> None:
        if not self._last:
            return
        newest = max(sample.at for sample in self._last.values())
        for key, sample in list(self._last.items()):
            if sample.at < newest - LIVE_STATS_WINDOW_S:
                del self._last[key]


def _growth(before: int, after: int) -> int:
    # A count that went down belongs to a restarted worker of the same name: it counts from 0.
    return after - before if after >= before else after


class NewSamples:
    """Per model, the latency samples already counted (those of the last LATE_SAMPLE_S before
    the newest), so each scrape reads an overlapping window and counts only what is new."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, float]] = defaultdict(dict)
        self._newest: dict[str, float] = {}

    def read_from(self, model: str, now: float) -> float:
        """The score to read the model's samples from."""
        return self._newest.get(model, now) - LATE_SAMPLE_S

    def take(self, model: str, members: Iterable[tuple[str, float]]) -> list[TtftSample]:
        """The samples among `members` (member, score) not taken before."""
        seen = self._seen[model]
        fresh = []
        for member, score in members:
            if member in seen:
                continue
            seen[member] = score
            try:
                fresh.append(TtftSample.parse(member, score))
            except ValueError:
                log.warning("ignoring an unreadable latency sample %r of %r", member, model)
        if seen:
            newest = max(self._newest.get(model, float("-inf")), *seen.values())
            self._newest[model] = newest
            for member, score in list(seen.items()):
                if score < newest - LATE_SAMPLE_S:
                    del seen[member]
        return fresh
