"""The system's load right now, read straight from Redis: live workers (KV usage, running,
waiting), the queues of every model (interactive and bulk streams), and dead letters; summed per
model in `ModelLoad`. `inferq status`, the dashboard and /metrics all start from this one read.

Cost: three SCANs (worker hashes, streams, dead-letter streams) and one pipelined round trip,
plus one XRANGE per stream for the age of its oldest waiting entry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

from redis.asyncio import Redis

from producer_api.workers import parse_heartbeat
from schemas import RedisKeys, WorkerInfo
from schemas.jobs import PriorityClass, as_text, decode_hash
from schemas.keys import decode_segment

# The kind of each of a model's two streams, and which priority class waits in it.
STREAM_KINDS = {"jobs": PriorityClass.INTERACTIVE, "bulk": PriorityClass.BATCH}


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
    quantization: str | None  # the weight quantization it runs; None: full precision
    weight_bytes: int | None  # None: a worker too old to say
    architecture: str | None  # what its engine serves the model as; None: a worker too old to say
    lora_adapters: list[str]  # the LoRA adapters it serves on its model, by name
    lora_resident: list[str]  # of those, the ones in its engine's slots now
    lora_cached: list[str]  # of those, the ones in its host memory only

    @classmethod
    def of(cls, info: WorkerInfo, now: float) -> WorkerView:
        """The view of a heartbeat: its fields of the same names, and its ages at `now`."""
        same = {f.name for f in fields(cls)} & WorkerInfo.model_fields.keys()
        return cls(
            **info.model_dump(include=same),
            kv_usage=info.kv_usage,
            heartbeat_age_s=max(now - info.updated_at.timestamp(), 0.0),
            uptime_s=max(now - info.started_at.timestamp(), 0.0),
        )


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

    @property
    def priority(self) -> PriorityClass:
        return STREAM_KINDS[self.kind]


@dataclass(frozen=True)
class DeadLetterView:
    model: str
    count: int
    last_reason: str | None
    last_message: str | None
    last_at: str | None


@dataclass(frozen=True)
class ModelLoad:
    """One model's load over all its workers and both its streams."""

    name: str
    workers: int
    kv_usage: float  # over all its workers' blocks
    running: int
    waiting: int  # admitted by a worker, not running yet
    queued: int  # in its streams, not taken by a worker yet
    dead_letters: int

    @classmethod
    def of(
        cls,
        name: str,
        workers: list[WorkerView],
        queues: list[QueueView],
        dead_letters: list[DeadLetterView],
    ) -> ModelLoad:
        """The load of `name` from the views of the whole system (other models' are skipped)."""
        mine = [w for w in workers if w.model == name]
        blocks_total = sum(w.kv_blocks_total for w in mine)
        blocks_free = sum(w.kv_blocks_free for w in mine)
        return cls(
            name=name,
            workers=len(mine),
            kv_usage=(1.0 - blocks_free / blocks_total) if blocks_total else 0.0,
            running=sum(w.running for w in mine),
            waiting=sum(w.waiting for w in mine),
            queued=sum(q.waiting for q in queues if q.model == name),
            dead_letters=sum(d.count for d in dead_letters if d.model == name),
        )


@dataclass(frozen=True)
class SystemLoad:
    at: float  # unix seconds it was read
    workers: list[WorkerView] = field(default_factory=list)
    queues: list[QueueView] = field(default_factory=list)
    dead_letters: list[DeadLetterView] = field(default_factory=list)

    def model_names(self) -> list[str]:
        """Every model with a live worker, a stream or dead letters."""
        return sorted(
            {w.model for w in self.workers}
            | {q.model for q in self.queues}
            | {d.model for d in self.dead_letters}
        )

    def models(self) -> list[ModelLoad]:
        return [
            ModelLoad.of(name, self.workers, self.queues, self.dead_letters)
            for name in self.model_names()
        ]


async def _scan(redis: Redis, pattern: str) -> list[str]:
    return sorted({as_text(key) async for key in redis.scan_iter(pattern, count=500)})


def _model_of(key: str, head: str) -> str:
    """The model of a per-model key `head + encoded model` (jobs, bulk, dead letters)."""
    return decode_segment(key[len(head) :])


async def read_load(redis: Redis, keys: RedisKeys) -> SystemLoad:
    """Workers, queues and dead letters of every model, read from Redis now."""
    now = time.time()
    worker_keys = await _scan(redis, keys.workers_pattern())
    patterns = keys.queue_stream_patterns()
    streams = [(k, kind) for kind, pattern in patterns.items() for k in await _scan(redis, pattern)]
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
        workers.append(WorkerView.of(live, now))

    queues = []
    for key, kind in streams:
        length, groups = take(2)
        backlog = await stream_backlog(redis, keys, key, length, groups, now)
        queues.append(QueueView(keys.model_of_jobs_stream(key), kind, key, *backlog))
    queues = merge_partitions(keys, queues)

    dead_letters = []
    for key in dead_keys:
        count, last = take(2)
        last_fields = decode_hash(last[0][1]) if last else {}
        dead_letters.append(
            DeadLetterView(
                model=_model_of(key, dead_head),
                count=int(count) if not isinstance(count, Exception) else 0,
                last_reason=last_fields.get("reason"),
                last_message=last_fields.get("message"),
                last_at=last_fields.get("at"),
            )
        )
    return SystemLoad(now, workers, queues, dead_letters)


async def read_model_queues(redis: Redis, keys: RedisKeys, model: str) -> list[QueueView]:
    """The two streams of one model, each over its partitions (no SCAN: cheap enough for a
    readiness probe)."""
    now = time.time()
    streams = [(key, "jobs") for key in keys.jobs_streams(model)]
    streams += [(key, "bulk") for key in keys.bulk_streams(model)]
    async with redis.pipeline(transaction=False) as pipe:
        for key, _kind in streams:
            pipe.xlen(key)
            pipe.xinfo_groups(key)
        replies = await pipe.execute(raise_on_error=False)
    queues = []
    for i, (key, kind) in enumerate(streams):
        length, groups = replies[2 * i], replies[2 * i + 1]
        backlog = await stream_backlog(redis, keys, key, length, groups, now)
        queues.append(QueueView(model, kind, key, *backlog))
    return merge_partitions(keys, queues)


def merge_partitions(keys: RedisKeys, queues: list[QueueView]) -> list[QueueView]:
    """One view per model and kind: the partition streams of a queue summed (the oldest
    waiting entry of any), named by the queue's first partition."""
    merged: dict[tuple[str, str], QueueView] = {}
    for view in queues:
        name = (view.model, view.kind)
        seen = merged.get(name)
        if seen is None:
            first = (
                keys.jobs_stream(view.model)
                if view.kind == "jobs"
                else keys.bulk_stream(view.model)
            )
            merged[name] = replace(view, stream=first)
            continue
        merged[name] = replace(
            seen,
            length=seen.length + view.length,
            pending=seen.pending + view.pending,
            oldest_waiting_age_s=max(seen.oldest_waiting_age_s, view.oldest_waiting_age_s),
        )
    return list(merged.values())


async def stream_backlog(
    redis: Redis, keys: RedisKeys, stream: str, length: object, groups: object, now: float
) -> tuple[int, int, float]:
    """(entries, pending, age of the oldest never-delivered entry) of a jobs stream, from its
    XLEN and XINFO GROUPS replies (errors there mean the stream does not exist yet)."""
    entries = 0 if isinstance(length, Exception) else int(str(length))
    pending, last_delivered = 0, None
    if isinstance(groups, list):
        for group in groups:
            if as_text(group.get("name", "")) == keys.group:
                pending = int(group.get("pending", 0))
                last_delivered = as_text(group.get("last-delivered-id", "0-0"))
    # Entries after the group's last-delivered id were never handed to a worker.
    start = "-" if last_delivered in (None, "0-0") else f"({last_delivered}"
    oldest = await redis.xrange(stream, min=start, max="+", count=1)
    age = 0.0
    if oldest:
        millis = int(as_text(oldest[0][0]).partition("-")[0])
        age = max(now - millis / 1000.0, 0.0)
    return entries, pending, age
