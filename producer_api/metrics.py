"""Prometheus metrics of one API process (a registry per app, so tests can build many apps).

Request counts come from an ASGI middleware (route template, method, status); queue and worker
gauges are read from Redis when /metrics is scraped, so they are exact at scrape time and cost
nothing between scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from redis.asyncio import Redis
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schemas import RedisKeys

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class QueueStats:
    model: str
    length: int  # XLEN: queued + running entries
    pending: int  # delivered to a worker and not acked yet (running)
    oldest_queued_age_s: float  # 0 when nothing waits


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
        self.queue_length = Gauge(
            "inferq_queue_length",
            "Jobs queued or running per model (jobs stream length)",
            ["model"],
            registry=self.registry,
        )
        self.queue_pending = Gauge(
            "inferq_queue_pending",
            "Jobs taken by a worker and not finished yet, per model",
            ["model"],
            registry=self.registry,
        )
        self.oldest_queued_age = Gauge(
            "inferq_queue_oldest_queued_age_seconds",
            "Age of the oldest job no worker has taken yet, per model",
            ["model"],
            registry=self.registry,
        )
        self.live_workers = Gauge(
            "inferq_live_workers",
            "Workers with a live heartbeat, per model",
            ["model"],
            registry=self.registry,
        )
        self.sse_connections = Gauge(
            "inferq_sse_connections", "Open Server-Sent Events streams", registry=self.registry
        )

    def set_queue_stats(self, stats: Iterable[QueueStats], workers: dict[str, int]) -> None:
        for gauge in (self.queue_length, self.queue_pending, self.oldest_queued_age):
            gauge.clear()
        self.live_workers.clear()
        for item in stats:
            self.queue_length.labels(item.model).set(item.length)
            self.queue_pending.labels(item.model).set(item.pending)
            self.oldest_queued_age.labels(item.model).set(item.oldest_queued_age_s)
        for model, count in workers.items():
            self.live_workers.labels(model).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def known_models(redis: Redis, keys: RedisKeys) -> list[str]:
    """Models that have a jobs stream (were ever enqueued for)."""
    streams = [k async for k in redis.scan_iter(keys.jobs_stream_pattern(), count=500)]
    return sorted(keys.model_of_jobs_stream(k) for k in streams)


async def queue_stats(redis: Redis, keys: RedisKeys, model: str) -> QueueStats:
    """A model's backlog over both of its streams (interactive and bulk)."""
    streams = (keys.jobs_stream(model), keys.bulk_stream(model))
    async with redis.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
        replies = await pipe.execute(raise_on_error=False)
    now = time.time()
    backlogs = [
        await stream_backlog(redis, keys, stream, *replies[2 * i : 2 * i + 2], now)
        for i, stream in enumerate(streams)
    ]
    return QueueStats(
        model,
        length=sum(b[0] for b in backlogs),
        pending=sum(b[1] for b in backlogs),
        oldest_queued_age_s=max(b[2] for b in backlogs),
    )


async def stream_backlog(
    redis: Redis, keys: RedisKeys, stream: str, length: object, groups: object, now: float
) -> tuple[int, int, float]:
    """(entries, pending, age of the oldest never-delivered entry) of a jobs stream, from its
    XLEN and XINFO GROUPS replies (errors there mean the stream does not exist yet)."""
    length = 0 if isinstance(length, Exception) else int(length)
    pending, last_delivered = 0, None
    if not isinstance(groups, Exception):
        for group in groups:
            if _text(group.get("name", "")) == keys.group:
                pending = int(group.get("pending", 0))
                last_delivered = _text(group.get("last-delivered-id", "0-0"))
    # Entries after the group's last-delivered id were never handed to a worker.
    start = "-" if last_delivered in (None, "0-0") else f"({last_delivered}"
    oldest = await redis.xrange(stream, min=start, max="+", count=1)
    age = 0.0
    if oldest:
        millis = int(_text(oldest[0][0]).partition("-")[0])
        age = max(now - millis / 1000.0, 0.0)
    return length, pending, age


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
