"""A snapshot of a running inferq system, read straight from Redis: models, live workers (KV
usage, running, waiting), queue depths, dead letters, and live rates (tokens/s, TTFT p50/p99
over recent windows) computed from the samples workers write with their heartbeats (see
`schemas.workers`). `inferq status` prints it; the API's `/dashboard/data` serves it as JSON.

Reading needs no state of its own: any process that can reach Redis (an API replica, an
operator's laptop) computes the same numbers. Cost: a few SCANs and one pipelined round trip.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

from redis.asyncio import Redis

from producer_api.metrics import stream_backlog
from producer_api.workers import parse_heartbeat
from schemas import RedisKeys
from schemas.keys import decode_segment
from schemas.workers import TokenSample, TtftSample

WINDOWS_S = (60, 300)  # the "last minutes" the rates are given for
SERIES_BUCKET_S = 10  # resolution of the tokens/s series (the dashboard's sparkline)


@dataclass(frozen=True)
class WorkerView:
    name: str
    model: str
    kv_usage: float  # fraction of KV blocks in use
    kv_blocks_free: int
    kv_blocks_total: int
    running: int
    waiting: int
    prompt_tokens: int
    generated_tokens: int
    heartbeat_age_s: float
    uptime_s: float
    version: str


@dataclass(frozen=True)
class QueueView:
    model: str
    kind: str  # "jobs" (interactive) or "bulk"
    stream: str
    length: int  # XLEN: queued + running
    pending: int  # delivered to a worker, not acked yet (running)
    oldest_waiting_age_s: float  # age of the oldest entry no worker took yet; 0 when none

    @property
    def waiting(self) -> int:
        return max(self.length - self.pending, 0)


@dataclass(frozen=True)
class DeadLetterView:
    model: str
    count: int
    last_reason: str | None
    last_message: str | None
    last_at: str | None


@dataclass(frozen=True)
class RateWindow:
    window_s: int
    generated_tokens: int  # tokens generated in the window (all workers of the model)
    tokens_per_s: float | None  # None: fewer than two heartbeats in the window
    prompt_tokens_per_s: float | None
    jobs_finished: int  # succeeded jobs with a TTFT in the window
    ttft_p50_s: float | None
    ttft_p99_s: float | None


@dataclass(frozen=True)
class ModelView:
    name: str
    workers: int
    kv_usage: float  # over all its workers' blocks
    running: int
    waiting: int  # admitted by a worker, not running yet
    queued: int  # in its streams, not taken by a worker yet
    dead_letters: int
    windows: list[RateWindow]
    tokens_per_s_series: list[tuple[float, float]]  # (bucket start unix s, tokens/s)


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


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


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


async def _scan(redis: Redis, pattern: str) -> list[str]:
    return sorted({_text(key) async for key in redis.scan_iter(pattern, count=500)})


def _model_of(key: str, head: str) -> str:
    """The model of a per-model key `head + encoded model` (jobs, bulk, dead letters)."""
    return decode_segment(key[len(head) :])


async def read_snapshot(
    redis: Redis, keys: RedisKeys, windows_s: tuple[int, ...] = WINDOWS_S
) -> StatusSnapshot:
    """Everything `inferq status` and the dashboard show, read from Redis now."""
    now = time.time()
    horizon = now - max(windows_s)
    worker_keys = await _scan(redis, keys.workers_pattern())
    heads = {"jobs": keys.jobs_stream(""), "bulk": keys.bulk_stream("")}
    streams = [(k, kind) for kind, head in heads.items() for k in await _scan(redis, head + "*")]
    dead_head = keys.dead_letters("")
    dead_keys = await _scan(redis, dead_head + "*")

    async with redis.pipeline(transaction=False) as pipe:
        for key in worker_keys:
            pipe.hgetall(key)
        for key, _kind in streams:
            pipe.xlen(key)
            pipe.xinfo_groups(key)
        for key in dead_keys:
            pipe.xlen(key)
            pipe.xrevrange(key, count=1)
        replies = await pipe.execute(raise_on_error=False)
    position = 0

    def take(count: int) -> list[Any]:
        nonlocal position
        position += count
        return replies[position - count : position]

    workers = []
    for data in take(len(worker_keys)):
        live = parse_heartbeat(data) if isinstance(data, dict) and data else None
        if live is None:
            continue  # expired between SCAN and HGETALL, or unreadable
        info = live.info
        workers.append(
            WorkerView(
                name=info.name,
                model=info.model,
                kv_usage=info.kv_usage,
                kv_blocks_free=info.kv_blocks_free,
                kv_blocks_total=info.kv_blocks_total,
                running=info.running,
                waiting=info.waiting,
                prompt_tokens=info.prompt_tokens,
                generated_tokens=info.generated_tokens,
                heartbeat_age_s=max(now - info.updated_at.timestamp(), 0.0),
                uptime_s=max(now - info.started_at.timestamp(), 0.0),
                version=info.version,
            )
        )

    queues = []
    for key, kind in streams:
        length, groups = take(2)
        model = _model_of(key, heads[kind])
        queues.append(await _queue_view(redis, keys, model, key, kind, length, groups, now))

    dead_letters = []
    for key in dead_keys:
        count, last = take(2)
        model = _model_of(key, dead_head)
        fields = {_text(k): _text(v) for k, v in last[0][1].items()} if last else {}
        dead_letters.append(
            DeadLetterView(
                model=model,
                count=int(count) if not isinstance(count, Exception) else 0,
                last_reason=fields.get("reason"),
                last_message=fields.get("message"),
                last_at=fields.get("at"),
            )
        )

    names = sorted(
        {w.model for w in workers} | {q.model for q in queues} | {d.model for d in dead_letters}
    )
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
                [w for w in workers if w.model == name],
                [q for q in queues if q.model == name],
                sum(d.count for d in dead_letters if d.model == name),
                [TtftSample.parse(member, score) for member, score in ttfts],
                [TokenSample.parse(member, score) for member, score in tokens],
                now,
                windows_s,
            )
        )
    return StatusSnapshot(now, keys.prefix, models, workers, queues, dead_letters)


async def _queue_view(
    redis: Redis,
    keys: RedisKeys,
    model: str,
    stream: str,
    kind: str,
    length: Any,
    groups: Any,
    now: float,
) -> QueueView:
    backlog = await stream_backlog(redis, keys, stream, length, groups, now)
    return QueueView(model, kind, stream, *backlog)


def _model_view(
    name: str,
    workers: list[WorkerView],
    queues: list[QueueView],
    dead_letters: int,
    ttfts: list[TtftSample],
    tokens: list[TokenSample],
    now: float,
    windows_s: tuple[int, ...],
) -> ModelView:
    windows = []
    for window in windows_s:
        recent = [s.ttft_s for s in ttfts if s.finished_at >= now - window]
        generated, per_s, prompt_per_s = token_rates(tokens, now, window)
        windows.append(
            RateWindow(
                window_s=window,
                generated_tokens=generated,
                tokens_per_s=per_s,
                prompt_tokens_per_s=prompt_per_s,
                jobs_finished=len(recent),
                ttft_p50_s=percentile(recent, 0.50),
                ttft_p99_s=percentile(recent, 0.99),
            )
        )
    blocks_total = sum(w.kv_blocks_total for w in workers)
    blocks_free = sum(w.kv_blocks_free for w in workers)
    return ModelView(
        name=name,
        workers=len(workers),
        kv_usage=(1.0 - blocks_free / blocks_total) if blocks_total else 0.0,
        running=sum(w.running for w in workers),
        waiting=sum(w.waiting for w in workers),
        queued=sum(q.waiting for q in queues),
        dead_letters=dead_letters,
        windows=windows,
        tokens_per_s_series=token_rate_series(tokens, now, max(windows_s)),
    )
