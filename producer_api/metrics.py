"""Prometheus metrics of one API process (a registry per app, so tests can build many apps).

Request counts come from an ASGI middleware (route template, method, status); the system's
series (queues, workers, tokens, latencies: `producer_api.system_metrics`) are read from Redis
when /metrics is scraped, so they are exact at scrape time and cost nothing between scrapes.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer_api.system_metrics import SystemMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "inferq_api_requests_total",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "inferq_api_request_duration_seconds",
            "Time to the response headers, by route template",
            ["route"],
            registry=self.registry,
        )
        self.sse_connections = Gauge(
            "inferq_sse_connections", "Open Server-Sent Events streams", registry=self.registry
        )
        self.system = SystemMetrics()
        self.registry.register(self.system)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetricsMiddleware:
    """Counts every HTTP response by route template (not raw path: ids would explode labels)."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                route = _route_of(scope)
                self.metrics.latency.labels(route).observe(time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.metrics.requests.labels(_route_of(scope), scope["method"], str(status)).inc()


def _route_of(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
