"""A snapshot of a running inferq system, read straight from Redis: models, live workers (KV
usage, running, waiting), queue depths, dead letters (`producer_api.load`), and live rates
(tokens/s, TTFT p50/p99 over recent windows, interactive and batch jobs apart: batch jobs wait
on purpose) computed from the samples workers write with their heartbeats (see
`schemas.workers`). `inferq status` prints it; the API's `/dashboard/data` serves it as JSON.

Reading needs no state of its own: any process that can reach Redis (an API replica, an
operator's laptop) computes the same numbers. Cost: a few SCANs and two pipelined round trips.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

from redis.asyncio import Redis

from producer_api.load import (
    DeadLetterView,
    ModelLoad,
    QueueView,
    SystemLoad,
    WorkerView,
    read_load,
)
from schemas import RedisKeys
from schemas.jobs import PriorityClass
from schemas.workers import TokenSample, TtftSample

WINDOWS_S = (60, 300)  # the "last minutes" the rates are given for
SERIES_BUCKET_S = 10  # resolution of the tokens/s series (the dashboard's sparkline)


@dataclass(frozen=True)
class TtftStats:
    """TTFT of the succeeded jobs of one priority class in a window."""

    jobs_finished: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None

    @classmethod
    def of(cls, ttfts: list[float]) -> TtftStats:
        return cls(len(ttfts), percentile(ttfts, 0.50), percentile(ttfts, 0.99))


@dataclass(frozen=True)
class RateWindow:
    window_s: int
    generated_tokens: int  # tokens generated in the window (all workers of the model)
    tokens_per_s: float | None  # None: fewer than two heartbeats in the window
    prompt_tokens_per_s: float | None
    jobs_finished: int  # succeeded jobs with a TTFT in the window, both priority classes
    interactive: TtftStats
    batch: TtftStats  # bulk-stream jobs: they wait behind interactive ones on purpose


@dataclass(frozen=True)
class ModelView(ModelLoad):
    windows: list[RateWindow] = field(default_factory=list)
    # (bucket start unix s, tokens/s)
    tokens_per_s_series: list[tuple[float, float]] = field(default_factory=list)


@dataclass(frozen=True)
class StatusSnapshot:
    at: float  # unix seconds the snapshot was taken
    prefix: str
    models: list[ModelView] = field(default_factory=list)
    workers: list[WorkerView] = field(default_factory=list)
    queues: list[QueueView] = field(default_factory=list)
    dead_letters: list[DeadLetterView] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for queue, data in zip(self.queues, out["queues"], strict=True):
            data["waiting"] = queue.waiting
        return out


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (`q` in 0..1) of `values`; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(math.ceil(q * len(ordered)), 1)
    return ordered[rank - 1]


def token_rates(
    samples: list[TokenSample], now: float, window_s: float
) -> tuple[int, float | None, float | None]:
    """(generated tokens, generated/s, prompt/s) over the samples of the last `window_s`:
    per worker the growth of its cumulative counters, over the time the window's samples span."""
    by_worker: dict[str, list[TokenSample]] = defaultdict(list)
    for sample in samples:
        if sample.at >= now - window_s:
            by_worker[sample.worker].append(sample)
    generated = prompt = 0
    first, last = math.inf, -math.inf
    for series in by_worker.values():
        series.sort(key=lambda s: s.at)
        if len(series) < 2:
            continue
        generated += max(series[-1].generated_tokens - series[0].generated_tokens, 0)
        prompt += max(series[-1].prompt_tokens - series[0].prompt_tokens, 0)
        first, last = min(first, series[0].at), max(last, series[-1].at)
    if last <= first:
        return generated, None, None
    span = last - first
    return generated, generated / span, prompt / span


def token_rate_series(
    samples: list[TokenSample], now: float, window_s: float, bucket_s: float = SERIES_BUCKET_S
) -> list[tuple[float, float]]:
    """Generated tokens/s per `bucket_s` bucket over the last `window_s` (oldest first): each
    pair of a worker's consecutive heartbeats puts its growth in the bucket of the later one."""
    start = now - window_s
    buckets = [0.0] * max(int(window_s // bucket_s), 1)
    by_worker: dict[str, list[TokenSample]] = defaultdict(list)
    for sample in samples:
        by_worker[sample.worker].append(sample)
    for series in by_worker.values():
        series.sort(key=lambda s: s.at)
        for before, after in pairwise(series):
            if after.at < start:
                continue
            index = min(int((after.at - start) // bucket_s), len(buckets) - 1)
            buckets[index] += max(after.generated_tokens - before.generated_tokens, 0)
    return [(start + i * bucket_s, tokens / bucket_s) for i, tokens in enumerate(buckets)]


async def read_snapshot(
    redis: Redis, keys: RedisKeys, windows_s: tuple[int, ...] = WINDOWS_S
) -> StatusSnapshot:
    """Everything `inferq status` and the dashboard show, read from Redis now."""
    load = await read_load(redis, keys)
    now = load.at
    horizon = now - max(windows_s)
    names = load.model_names()
    async with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.zrangebyscore(keys.ttft_samples(name), horizon, "+inf", withscores=True)
            # One beat before the window too, so the window's first interval is counted.
            pipe.zrangebyscore(keys.token_samples(name), horizon - 30, "+inf", withscores=True)
        samples = await pipe.execute(raise_on_error=False)
    models = []
    for i, name in enumerate(names):
        ttft_raw, token_raw = samples[2 * i], samples[2 * i + 1]
        ttfts = [] if isinstance(ttft_raw, Exception) else ttft_raw
        tokens = [] if isinstance(token_raw, Exception) else token_raw
        models.append(
            _model_view(
                name,
                load,
                [TtftSample.parse(member, score) for member, score in ttfts],
                [TokenSample.parse(member, score) for member, score in tokens],
                now,
                windows_s,
            )
        )
    return StatusSnapshot(now, keys.prefix, models, load.workers, load.queues, load.dead_letters)


def _model_view(
    name: str,
    load: SystemLoad,
    ttfts: list[TtftSample],
    tokens: list[TokenSample],
    now: float,
    windows_s: tuple[int, ...],
) -> ModelView:
    windows = []
    for window in windows_s:
        recent = [s for s in ttfts if s.finished_at >= now - window]
        generated, per_s, prompt_per_s = token_rates(tokens, now, window)
        by_class = {
            priority: TtftStats.of([s.ttft_s for s in recent if s.priority is priority])
            for priority in PriorityClass
        }
        windows.append(
            RateWindow(
                window_s=window,
                generated_tokens=generated,
                tokens_per_s=per_s,
                prompt_tokens_per_s=prompt_per_s,
                jobs_finished=len(recent),
                interactive=by_class[PriorityClass.INTERACTIVE],
                batch=by_class[PriorityClass.BATCH],
            )
        )
    model = ModelLoad.of(name, load.workers, load.queues, load.dead_letters)
    return ModelView(
        **asdict(model),
        windows=windows,
        tokens_per_s_series=token_rate_series(tokens, now, max(windows_s)),
    )
