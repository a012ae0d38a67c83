"""Prometheus metrics of one worker (a private registry, so tests can run several workers)."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from engine.outputs import EngineStats

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)


class WorkerMetrics:
    """Counters, gauges and histograms of a worker; `serve(port)` exposes them over HTTP."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model = model
        labels = ["model"]
        r = self.registry
        self.requests = Counter(
            "inferq_worker_requests",
            "Jobs ended by this worker, by outcome",
            [*labels, "outcome"],
            registry=r,
        )
        self.running = Gauge(
            "inferq_worker_running", "Requests in the running batch", labels, registry=r
        )
        self.waiting = Gauge(
            "inferq_worker_waiting", "Requests admitted, not yet running", labels, registry=r
        )
        self.kv_usage = Gauge(
            "inferq_worker_kv_cache_usage", "Fraction of KV blocks in use", labels, registry=r
        )
        self.kv_free = Gauge("inferq_worker_kv_blocks_free", "Free KV blocks", labels, registry=r)
        self.prefix_hit_rate = Gauge(
            "inferq_worker_prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache",
            labels,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "inferq_worker_prompt_tokens", "Prompt tokens computed", labels, registry=r
        )
        self.generation_tokens = Counter(
            "inferq_worker_generation_tokens", "Tokens generated", labels, registry=r
        )
        self.ttft = Histogram(
            "inferq_worker_time_to_first_token_seconds",
            "Enqueue to first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "inferq_worker_time_per_output_token_seconds",
            "Decode time per output token",
            labels,
            buckets=_TOKEN_TIME_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "inferq_worker_queue_wait_seconds",
            "Enqueue to start",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "inferq_worker_request_seconds",
            "Enqueue to result",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "inferq_worker_step_seconds",
            "Engine step duration",
            labels,
            buckets=_TOKEN_TIME_BUCKETS,
            registry=r,
        )
        self.flush_time = Histogram(
            "inferq_worker_publish_seconds",
            "One outbox pipeline round trip",
            labels,
            buckets=_TOKEN_TIME_BUCKETS,
            registry=r,
        )
        self.redis_errors = Counter(
            "inferq_worker_redis_errors",
            "Redis calls that failed (connection lost)",
            labels,
            registry=r,
        )
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
