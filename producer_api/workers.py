"""Which workers are alive and which models they serve, read from their heartbeat hashes.

A heartbeat hash `{p}:worker:{name}` expires HEARTBEAT_TTL_S after the worker's last beat, so
every hash that exists is a live worker. The list is re-read at most every `cache_s` seconds:
requests check the model on every call, and a SCAN per request would cost more than the rest.

A model's quantization is its workers' (None: full precision); workers of one model that run
different methods make it "mixed", with each method in `quantizations`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from pydantic import ValidationError
from redis.asyncio import Redis

from schemas import JobKind, RedisKeys, WorkerInfo

log = logging.getLogger(__name__)

MIXED_QUANTIZATION = "mixed"  # a model whose workers run different quantizations


@dataclass(frozen=True)
class ServedModel:
    name: str
    workers: int
    max_model_len: int | None  # the smallest context among its workers (any may run a job)
    since: float  # unix time the longest-running worker started
    vocab_size: int | None = None  # the smallest vocabulary among its workers
    tokenizer_file: str | None = None  # a tokenizer.json one of its workers advertises
    # the distinct quantizations of its workers, full precision (None) first, then by name
    quantizations: tuple[str | None, ...] = ()
    # the distinct architectures its workers serve it as, by name (none: workers too old to say)
    architectures: tuple[str, ...] = ()
    tasks: frozenset[JobKind] = frozenset()  # the kinds of job its workers take
    embedding_size: int | None = None  # the smallest vector size among its embedding workers
    # a LoRA adapter's entry: the base model its jobs run on (its bounds are the base's, its
    # `workers` those advertising the adapter); None for a model
    parent: str | None = None

    @property
    def quantization(self) -> str | None:
        """Its workers' quantization when they agree (None: full precision), else "mixed"."""
        if len(self.quantizations) > 1:
            return MIXED_QUANTIZATION
        return self.quantizations[0] if self.quantizations else None

    def joined_by(self, info: WorkerInfo) -> ServedModel:
        """This model with one more live worker: every bound is the tightest of the two."""
        return ServedModel(
            self.name,
            self.workers + 1,
            _smallest(self.max_model_len, info.max_model_len),
            min(self.since, info.started_at.timestamp()),
            _smallest(self.vocab_size, info.vocab_size),
            self.tokenizer_file or info.tokenizer_file,
            _distinct((*self.quantizations, info.quantization)),
            tuple(sorted({*self.architectures, *filter(None, [info.architecture])})),
            self.tasks | {info.task},
            _smallest(self.embedding_size, info.embedding_size),
        )


def _distinct(methods: tuple[str | None, ...]) -> tuple[str | None, ...]:
    return tuple(sorted(set(methods), key=lambda m: (m is not None, m or "")))


def _smallest(a: int | None, b: int | None) -> int | None:
    known = [n for n in (a, b) if n is not None]
    return min(known) if known else None


def parse_heartbeat(data: dict[str | bytes, str | bytes]) -> WorkerInfo | None:
    """The worker a heartbeat hash describes; None when the hash cannot be read as one."""
    try:
        return WorkerInfo.from_redis_hash(data)
    except ValidationError:
        return None


class WorkerDirectory:
    def __init__(self, redis: Redis, keys: RedisKeys, cache_s: float = 1.0) -> None:
        self.redis = redis
        self.keys = keys
        self.cache_s = cache_s
        self._cached: list[WorkerInfo] | None = None
        self._read_at = 0.0
        self._lock = asyncio.Lock()

    async def live(self) -> list[WorkerInfo]:
        loop = asyncio.get_running_loop()
        if self._cached is not None and loop.time() - self._read_at < self.cache_s:
            return self._cached
        async with self._lock:
            if self._cached is None or loop.time() - self._read_at >= self.cache_s:
                self._cached = await self._read()
                self._read_at = loop.time()
            return self._cached

    def forget(self) -> None:
        """Drop the cached list (tests, or after a worker is known to have changed)."""
        self._cached = None

    async def _read(self) -> list[WorkerInfo]:
        names = [key async for key in self.redis.scan_iter(self.keys.workers_pattern(), count=500)]
        if not names:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(name)
            hashes = await pipe.execute()
        workers = []
        for name, data in zip(names, hashes, strict=True):
            if not data:
                continue  # expired between SCAN and HGETALL
            worker = parse_heartbeat(data)
            if worker is None:
                log.warning("ignoring an unreadable worker heartbeat %r", name)
                continue
            workers.append(worker)
        return workers

    async def models(self) -> dict[str, ServedModel]:
        """Every served model by name, and every LoRA adapter a live worker advertises (as an
        entry with its base model as `parent`; a model's own name wins over an adapter's)."""
        workers = await self.live()
        served: dict[str, ServedModel] = {}
        for worker in workers:
            name = worker.model
            known = served.get(name) or ServedModel(name, 0, None, float("inf"))
            served[name] = known.joined_by(worker)
        adapters: dict[str, ServedModel] = {}
        for worker in sorted(workers, key=lambda w: w.model):
            for adapter in worker.lora_adapters:
                if adapter in served:
                    continue
                entry = adapters.get(adapter) or replace(
                    served[worker.model], name=adapter, workers=0, parent=worker.model
                )
                if entry.parent == worker.model:
                    adapters[adapter] = replace(entry, workers=entry.workers + 1)
        return {**served, **adapters}
