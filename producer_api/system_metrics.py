"""The whole system's metrics, per model, for the API's /metrics: what `inferq status` and the
dashboard show (queues of both priority classes, workers, KV-cache usage, running and waiting
requests, dead letters, tokens/s) plus token counters and latency histograms, read from Redis
when Prometheus scrapes.

Every series comes under inferq's names (label `model`) and, for the ones vLLM has, under
vLLM's names too (label `model_name`), so a Grafana board made for vLLM works unchanged:

    vllm:num_requests_running        gauge      requests in the workers' running batches
    vllm:num_requests_waiting        gauge      admitted by a worker but not running, plus
                                                queued in the model's streams (both classes)
    vllm:kv_cache_usage_perc         gauge      fraction of the workers' KV blocks in use (0-1)
    vllm:prompt_tokens_total         counter    prompt tokens computed
    vllm:generation_tokens_total     counter    tokens generated
    vllm:time_to_first_token_seconds histogram  enqueue to first token
    vllm:inter_token_latency_seconds histogram  time between output tokens (each job's mean,
                                                once per gap)
    vllm:e2e_request_latency_seconds histogram  enqueue to result

The histograms have a `priority` label too ("interactive" or "batch": bulk-stream jobs wait
behind interactive ones on purpose, so their TTFT says nothing about a person's wait); a board
that sums over it sees all jobs. Histograms count succeeded jobs.

Each API replica reports the whole system, not its own share: scrape one replica, or aggregate
replicas with max(), never sum().
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from operator import attrgetter

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from redis.asyncio import Redis

from producer_api.live_counters import (
    CumulativeHistogram,
    LatencyHistograms,
    NewSamples,
    TokenCounters,
)
from producer_api.load import ModelLoad, QueueView, SystemLoad, read_load
from producer_api.status import token_rates
from schemas import RedisKeys
from schemas.jobs import PriorityClass
from schemas.workers import TokenSample

log = logging.getLogger(__name__)

RATE_WINDOW_S = 60  # the tokens/s gauges: the last minute, as `inferq status` shows first
BEAT_MARGIN_S = 30  # token samples read before a window, so its first interval counts


class SystemMetrics(Collector):
    """Scrape-time metrics of the system; `refresh()` reads Redis, `collect()` renders."""

    def __init__(self) -> None:
        self._load = SystemLoad(at=0.0)
        self._rates: dict[str, tuple[float | None, float | None]] = {}  # generated/s, prompt/s
        self._tokens = TokenCounters()
        self._latency: dict[tuple[str, PriorityClass], LatencyHistograms] = {}
        self._new_samples = NewSamples()
        self._refreshed_at: float | None = None

    async def refresh(self, redis: Redis, keys: RedisKeys) -> None:
        """Read the load and the samples written since the last refresh."""
        load = await read_load(redis, keys)
        now = load.at
        names = load.model_names()
        since = now - RATE_WINDOW_S - BEAT_MARGIN_S
        if self._refreshed_at is not None:
            # Scrapes further apart than the window: still see every worker's last count.
            since = min(since, self._refreshed_at - BEAT_MARGIN_S)
        async with redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.zrangebyscore(keys.token_samples(name), since, "+inf", withscores=True)
                start = self._new_samples.read_from(name, now)
                pipe.zrangebyscore(keys.ttft_samples(name), start, "+inf", withscores=True)
            replies = await pipe.execute(raise_on_error=False)
        rates = {}
        for i, name in enumerate(names):
            token_raw, latency_raw = replies[2 * i], replies[2 * i + 1]
            tokens = [] if isinstance(token_raw, Exception) else _token_samples(token_raw, name)
            self._tokens.add(name, tokens)
            _generated, per_s, prompt_per_s = token_rates(tokens, now, RATE_WINDOW_S)
            rates[name] = (per_s, prompt_per_s)
            if not isinstance(latency_raw, Exception):
                for sample in self._new_samples.take(name, latency_raw):
                    key = (name, sample.priority)
                    self._latency.setdefault(key, LatencyHistograms()).observe(sample)
        self._load, self._rates, self._refreshed_at = load, rates, now

    def collect(self) -> Iterator[Metric]:
        models = self._load.models()
        yield from _load_gauges(models, self._load)
        yield _gauge(
            "inferq_generation_tokens_per_second",
            f"Tokens generated per second over the last {RATE_WINDOW_S} s",
            "model",
            {m: r[0] for m, r in self._rates.items() if r[0] is not None},
        )
        yield _gauge(
            "inferq_prompt_tokens_per_second",
            f"Prompt tokens computed per second over the last {RATE_WINDOW_S} s",
            "model",
            {m: r[1] for m, r in self._rates.items() if r[1] is not None},
        )
        for prefix, label in (("inferq_", "model"), ("vllm:", "model_name")):
            for name, documentation, counts in (
                ("prompt_tokens", "Prompt tokens computed", self._tokens.prompt),
                ("generation_tokens", "Tokens generated", self._tokens.generated),
            ):
                yield _gauge(prefix + name, documentation, label, counts, CounterMetricFamily)
            yield from self._histograms(prefix, label)

    def _histograms(self, prefix: str, label: str) -> Iterator[Metric]:
        kinds: list[tuple[str, str, Callable[[LatencyHistograms], CumulativeHistogram]]] = [
            (
                "time_to_first_token_seconds",
                "Time from enqueue to the first token",
                attrgetter("ttft"),
            ),
            ("inter_token_latency_seconds", "Time between two output tokens", attrgetter("itl")),
            ("e2e_request_latency_seconds", "Time from enqueue to the result", attrgetter("e2e")),
        ]
        for name, documentation, pick in kinds:
            family = HistogramMetricFamily(
                prefix + name, f"{documentation} (succeeded jobs)", labels=[label, "priority"]
            )
            for (model, priority), histograms in sorted(self._latency.items()):
                histogram = pick(histograms)
                family.add_metric([model, priority.value], histogram.buckets(), histogram.sum)
            yield family


def _token_samples(raw: list[tuple[str, float]], model: str) -> list[TokenSample]:
    samples = []
    for member, score in raw:
        try:
            samples.append(TokenSample.parse(member, score))
        except ValueError:
            log.warning("ignoring an unreadable token sample %r of %r", member, model)
    return samples


def _load_gauges(models: list[ModelLoad], load: SystemLoad) -> Iterator[Metric]:
    per_model: list[tuple[str, str, Callable[[ModelLoad], float]]] = [
        ("inferq_live_workers", "Workers with a live heartbeat", lambda m: m.workers),
        (
            "inferq_requests_running",
            "Requests in the workers' running batches",
            lambda m: m.running,
        ),
        (
            "inferq_requests_waiting",
            "Requests a worker admitted that do not run yet (queued jobs: inferq_queue_waiting)",
            lambda m: m.waiting,
        ),
        (
            "inferq_kv_cache_usage",
            "Fraction of the workers' KV-cache blocks in use (0-1)",
            lambda m: m.kv_usage,
        ),
        ("inferq_dead_letters", "Entries in the dead-letter stream", lambda m: m.dead_letters),
    ]
    for name, documentation, value in per_model:
        yield _gauge(name, documentation, "model", _of(models, value))
    queues_of = {m.name: [q for q in load.queues if q.model == m.name] for m in models}
    per_queues: list[tuple[str, str, Callable[[list[QueueView]], float]]] = [
        (
            "inferq_queue_length",
            "Jobs queued or running (both streams' length)",
            lambda queues: sum(q.length for q in queues),
        ),
        (
            "inferq_queue_pending",
            "Jobs taken by a worker and not finished yet",
            lambda queues: sum(q.pending for q in queues),
        ),
        (
            "inferq_queue_oldest_queued_age_seconds",
            "Age of the oldest job no worker has taken yet, over both streams",
            lambda queues: max(q.oldest_waiting_age_s for q in queues),
        ),
    ]
    for name, documentation, over in per_queues:
        values = {model: over(queues) for model, queues in queues_of.items() if queues}
        yield _gauge(name, documentation, "model", values)
    waiting = GaugeMetricFamily(
        "inferq_queue_waiting",
        "Jobs no worker has taken yet, by priority class (batch: the bulk stream)",
        labels=["model", "priority"],
    )
    oldest = GaugeMetricFamily(
        "inferq_queue_oldest_waiting_age_seconds",
        "Age of the oldest job no worker has taken yet, by priority class",
        labels=["model", "priority"],
    )
    for queue in load.queues:
        waiting.add_metric([queue.model, queue.priority.value], queue.waiting)
        oldest.add_metric([queue.model, queue.priority.value], queue.oldest_waiting_age_s)
    yield waiting
    yield oldest
    yield _gauge(
        "vllm:num_requests_running",
        "Number of requests in the running batches of the model's workers",
        "model_name",
        _of(models, lambda m: m.running),
    )
    yield _gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting: admitted by a worker but not running, or queued",
        "model_name",
        {m.name: m.waiting + m.queued for m in models},
    )
    yield _gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage of the model's workers. 1 means 100 percent usage",
        "model_name",
        _of(models, lambda m: m.kv_usage),
    )


def _of(models: list[ModelLoad], value: Callable[[ModelLoad], float]) -> dict[str, float]:
    return {m.name: float(value(m)) for m in models}


def _gauge(
    name: str,
    documentation: str,
    label: str,
    values: Mapping[str, float],
    kind: type[GaugeMetricFamily | CounterMetricFamily] = GaugeMetricFamily,
) -> Metric:
    family = kind(name, documentation, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family
