"""Prometheus metrics of one worker (a private registry, so tests can run several workers)."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from engine.outputs import EngineStats

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
_HANDOFF_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064)


class WorkerMetrics:
    """Counters, gauges and histograms of a worker; `serve(port)` exposes them over HTTP."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model = model
        labels = ["model"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.requests = Counter(
            "inferq_worker_requests",
            "Jobs ended by this worker, by outcome",
            [*labels, "outcome"],
            registry=self.registry,
        )
        self.running = gauge("inferq_worker_running", "Requests in the running batch")
        self.waiting = gauge("inferq_worker_waiting", "Requests admitted, not yet running")
        self.kv_usage = gauge("inferq_worker_kv_cache_usage", "Fraction of KV blocks in use")
        self.kv_free = gauge("inferq_worker_kv_blocks_free", "Free KV blocks")
        self.prefix_hit_rate = gauge(
            "inferq_worker_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache"
        )
        self.prompt_tokens = counter("inferq_worker_prompt_tokens", "Prompt tokens computed")
        self.generation_tokens = counter("inferq_worker_generation_tokens", "Tokens generated")
        self.ttft = histogram(
            "inferq_worker_time_to_first_token_seconds", "Enqueue to first token", _LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "inferq_worker_time_per_output_token_seconds",
            "Decode time per output token",
            _TOKEN_TIME_BUCKETS,
        )
        self.queue_wait = histogram(
            "inferq_worker_queue_wait_seconds", "Enqueue to start", _LATENCY_BUCKETS
        )
        self.e2e = histogram("inferq_worker_request_seconds", "Enqueue to result", _LATENCY_BUCKETS)
        self.step_time = histogram(
            "inferq_worker_step_seconds", "Engine step duration", _TOKEN_TIME_BUCKETS
        )
        self.engine_wait = histogram(
            "inferq_worker_engine_wait_seconds",
            "Engine idle between two steps of a running batch, waiting on the worker's loop",
            _HANDOFF_BUCKETS,
        )
        self.flush_time = histogram(
            "inferq_worker_publish_seconds", "One outbox pipeline round trip", _TOKEN_TIME_BUCKETS
        )
        self.redis_errors = counter(
            "inferq_worker_redis_errors", "Redis calls that failed (connection lost)"
        )
        self.chunks_republished = counter(
            "inferq_worker_chunks_republished",
            "Chunks re-published because a failover lost them from the replay stream",
        )
        self.spec_draft_tokens = counter(
            "inferq_worker_spec_draft_tokens", "Speculative draft tokens proposed and verified"
        )
        self.spec_accepted_tokens = counter(
            "inferq_worker_spec_accepted_tokens", "Speculative draft tokens accepted"
        )
        self.spec_acceptance_rate = gauge(
            "inferq_worker_spec_acceptance_rate", "Accepted per proposed draft token, so far"
        )
        self.spec_mean_accepted_length = gauge(
            "inferq_worker_spec_mean_accepted_length",
            "Draft tokens accepted per verification step, so far",
        )
        self._last_spec_draft_tokens = 0
        self._last_spec_accepted_tokens = 0
        self._last_prompt_tokens = 0
        self._last_generation_tokens = 0
        self._server: Any = None

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.model, outcome).inc()

    def observe_stats(self, stats: EngineStats) -> None:
        """Update gauges and token counters from an EngineStats snapshot."""
        m = self.model
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.kv_free.labels(m).set(stats.num_blocks_free)
        self.prefix_hit_rate.labels(m).set(stats.prefix_cache_hit_rate)
        prompt, generated = stats.num_prompt_tokens_computed, stats.num_generation_tokens
        if prompt > self._last_prompt_tokens:
            self.prompt_tokens.labels(m).inc(prompt - self._last_prompt_tokens)
        if generated > self._last_generation_tokens:
            self.generation_tokens.labels(m).inc(generated - self._last_generation_tokens)
        self._last_prompt_tokens, self._last_generation_tokens = prompt, generated
        self._observe_speculation(stats)

    def _observe_speculation(self, stats: EngineStats) -> None:
        m = self.model
        drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        if drafted > self._last_spec_draft_tokens:
            self.spec_draft_tokens.labels(m).inc(drafted - self._last_spec_draft_tokens)
        if accepted > self._last_spec_accepted_tokens:
            self.spec_accepted_tokens.labels(m).inc(accepted - self._last_spec_accepted_tokens)
        self._last_spec_draft_tokens, self._last_spec_accepted_tokens = drafted, accepted
        self.spec_acceptance_rate.labels(m).set(stats.spec_acceptance_rate)
        self.spec_mean_accepted_length.labels(m).set(stats.spec_mean_accepted_length)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Expose /metrics; returns the bound port (useful with port 0)."""
        server, _thread = start_http_server(port, host, registry=self.registry)
        self._server = server
        return server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
