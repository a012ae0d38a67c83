"""A worker's Prometheus metrics carry the engine's speculative decoding counts."""

from __future__ import annotations

from dataclasses import replace

from engine.outputs import EngineStats
from worker.metrics import WorkerMetrics

MODEL = "m"


def _stats(drafts: int, drafted: int, accepted: int) -> EngineStats:
    return EngineStats(
        num_blocks_total=10,
        num_blocks_free=10,
        num_blocks_cached=0,
        num_running=0,
        num_waiting=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_prompt_tokens_computed=0,
        num_generation_tokens=0,
        num_preemptions=0,
        num_steps=0,
        spec_num_drafts=drafts,
        spec_num_draft_tokens=drafted,
        spec_num_accepted_tokens=accepted,
    )


def test_speculation_counters_and_rates_follow_the_engine() -> None:
    metrics = WorkerMetrics(MODEL)
    first = _stats(drafts=5, drafted=20, accepted=10)
    metrics.observe_stats(first)
    metrics.observe_stats(replace(first, spec_num_drafts=10, spec_num_draft_tokens=40))

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model": MODEL})

    assert value("inferq_worker_spec_draft_tokens_total") == 40
    assert value("inferq_worker_spec_accepted_tokens_total") == 10
    assert value("inferq_worker_spec_acceptance_rate") == 0.25
    assert value("inferq_worker_spec_mean_accepted_length") == 1.0


def test_an_engine_without_speculation_reports_zeros() -> None:
    metrics = WorkerMetrics(MODEL)
    metrics.observe_stats(_stats(0, 0, 0))
    assert (
        metrics.registry.get_sample_value("inferq_worker_spec_acceptance_rate", {"model": MODEL})
        == 0
    )
