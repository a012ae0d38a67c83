"""The cumulative series /metrics builds from the workers' sliding-window samples: histograms
with weighted observations, token counters across worker restarts, and latency samples counted
once however often overlapping windows are read."""

from __future__ import annotations

import pytest

from producer_api.live_counters import (
    LATE_SAMPLE_S,
    CumulativeHistogram,
    LatencyHistograms,
    NewSamples,
    TokenCounters,
)
from schemas.jobs import PriorityClass
from schemas.workers import TokenSample, TtftSample


def test_histogram_buckets_are_cumulative_and_inclusive():
    histogram = CumulativeHistogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    histogram.observe(0.2, count=3)
    assert histogram.buckets() == [("0.1", 2.0), ("1.0", 6.0), ("+Inf", 7.0)]
    assert histogram.count == 7
    assert histogram.sum == pytest.approx(0.05 + 0.1 + 0.5 + 3.0 + 0.6)


def test_a_jobs_mean_inter_token_latency_counts_once_per_gap():
    histograms = LatencyHistograms()
    histograms.observe(TtftSample(0.0, 0.2, "job_a", PriorityClass.BATCH, 1.2, 0.05, 21))
    histograms.observe(TtftSample(0.0, 0.3, "job_b"))  # an old member: TTFT only
    assert (histograms.ttft.count, histograms.e2e.count, histograms.itl.count) == (2, 1, 20)
    assert histograms.itl.sum == pytest.approx(1.0)


def test_token_counters_add_growth_across_beats_workers_and_restarts():
    counters = TokenCounters()
    counters.add("m", [TokenSample(10.0, "a", 100, 40), TokenSample(12.0, "a", 150, 40)])
    counters.add("m", [TokenSample(12.0, "a", 150, 40), TokenSample(14.0, "a", 160, 50)])
    assert (counters.generated["m"], counters.prompt["m"]) == (160, 50)
    counters.add("m", [TokenSample(14.0, "b", 30, 5)])  # a second worker, first seen
    counters.add("m", [TokenSample(16.0, "a", 7, 3)])  # worker a restarted under its name
    assert (counters.generated["m"], counters.prompt["m"]) == (197, 58)


def test_overlapping_reads_count_each_latency_sample_once():
    seen = NewSamples()
    first = [TtftSample(100.0, 0.1, "job_1"), TtftSample(101.0, 0.2, "job_2")]
    members = [(s.member(), s.finished_at) for s in first]
    assert seen.read_from("m", now=105.0) == 105.0 - LATE_SAMPLE_S
    assert seen.take("m", members) == first
    late = TtftSample(99.0, 0.3, "job_3")  # written after the read, finished before
    assert seen.take("m", [*members, (late.member(), late.finished_at)]) == [late]
    assert seen.read_from("m", now=200.0) == 101.0 - LATE_SAMPLE_S
    assert seen.take("m", [("garbage", 102.0)]) == []
