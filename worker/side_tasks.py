"""The tasks a worker runs beside its loop: the heartbeat, the cancel and arrivals listener,
lease renewal of the held entries, and a periodic look at the held jobs' statuses. A side task
never dies of an error, and Redis being away only makes it try again next time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime

from redis.asyncio import Redis

from engine.outputs import EngineStats
from worker.backoff import Backoff
from worker.batch import Batch
from worker.batch_jobs import AbortReason
from worker.control import REDIS_DOWN, ended_jobs, listen
from worker.engine_api import EngineLike
from worker.heartbeat import beat
from worker.held import HeldJob
from worker.janitor import renew_leases
from worker.logs import log_event
from worker.settings import WorkerSettings
from worker.shard_homes import ShardHomes

logger = logging.getLogger(__name__)


class SideTasks:
    """A worker's side tasks (`all`), on `redis`, about the jobs `batch` holds."""

    def __init__(
        self,
        settings: WorkerSettings,
        redis: Redis,
        engine: EngineLike,
        batch: Batch,
        current_stats: Callable[[], EngineStats],
        on_arrival: Callable[[], None],
        started_at: datetime,
        held_jobs: Callable[[], list[HeldJob]] | None = None,
        homes: ShardHomes | None = None,
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self.model = settings.queue_model
        self.keys = settings.redis_keys(settings.prefix)
        self.jobs_stream = self.keys.jobs_stream(self.model)
        self.redis = redis
        self.engine = engine
        self.batch = batch
        self.current_stats = current_stats
        self.on_arrival = on_arrival
        self.started_at = started_at
        # every job whose entry it holds: the batch's, and those offered to other workers
        self.held_jobs = held_jobs or batch.all_jobs
        self.homes = homes  # on a cluster: refreshed with each heartbeat
        self._control = Backoff(settings.reconnect_min_s, settings.reconnect_max_s)
        self._lora_changed = asyncio.Event()

    def all(self, closing: asyncio.Event) -> list[Coroutine[None, None, None]]:
        """The side tasks to run until `closing`."""
        settings = self.settings
        return [
            every(settings.heartbeat_interval_s, self._beat, closing),
            listen(
                self.redis,
                self.keys,
                self.model,
                self._on_cancel,
                self.on_arrival,
                self._lora_changed.set,
                self._control,
                closing,
            ),
            self._follow_lora_registry(closing),
            every(settings.lease_interval_s, self._renew_leases, closing),
            every(settings.status_check_interval_s, self._check_statuses, closing),
        ]

    async def _follow_lora_registry(self, closing: asyncio.Event) -> None:
        """Re-read the model's run-time LoRA registry when told it changed, and every heartbeat
        interval in case a broadcast was missed (or this worker started after it)."""
        if not self.settings.lora_enabled:
            return
        while not closing.is_set():
            self._lora_changed.clear()
            try:
                before = self.batch.lora.names()
                await self.batch.lora.refresh(self.redis, self.keys, self.model)
                if self.batch.lora.names() != before:
                    await self._beat()  # the API waits for the heartbeat to show the change
            except REDIS_DOWN:
                pass  # the main loop reports and backs off; try again next time
            except Exception:
                logger.exception("reading the LoRA registry failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._lora_changed.wait(), self.settings.heartbeat_interval_s
                )

    def _on_cancel(self, job_id: str) -> None:
        self.batch.request_abort(job_id, AbortReason.ENDED)

    async def _beat(self) -> None:
        ttfts = self.batch.ttfts.take()
        stats = self.current_stats()
        lora = self.batch.lora
        try:
            await beat(
                self.redis,
                self.keys,
                name=self.name,
                model=self.model,
                stats=stats,
                started_at=self.started_at,
                ttl_s=self.settings.heartbeat_ttl_s,
                max_model_len=self.engine.max_model_len,
                vocab_size=self.engine.vocab_size,
                tokenizer_file=self.engine.tokenizer_file,
                quantization=self.engine.quantization,
                weight_bytes=self.engine.weight_bytes,
                architecture=self.engine.architecture,
                task=self.engine.task,
                embedding_size=self.engine.embedding_size,
                lora_adapters=lora.names(),
                lora_resident=lora.names_of(stats.lora_resident),
                lora_cached=lora.names_of(stats.lora_cached),
                ttfts=ttfts,
            )
        except BaseException:
            self.batch.ttfts.put_back(ttfts)  # written with the next beat
            raise
        if self.homes is not None:
            await self.homes.beat(self.settings.heartbeat_ttl_s)

    async def _renew_leases(self) -> None:
        by_stream: dict[str, dict[str, str]] = {}
        for h in self.held_jobs():
            by_stream.setdefault(h.queue_stream or self.jobs_stream, {})[h.entry_id] = h.job_id
        for stream, entries in by_stream.items():
            lost = await renew_leases(self.redis, self.keys, stream, self.name, set(entries))
            for entry_id in lost:
                held = self.batch.held.get(entries[entry_id])
                if held is not None and held.entry_id == entry_id:
                    log_event(
                        logger, logging.WARNING, "lease_lost", job=held.job_id, entry=entry_id
                    )
                    self.batch.request_abort(held.job_id, AbortReason.LOST)

    async def _check_statuses(self) -> None:
        """Catch cancels whose broadcast this worker missed (e.g. while Redis was away)."""
        job_ids = [h.job_id for h in self.batch.all_jobs()]
        for job_id in await ended_jobs(self.redis, self.keys, job_ids):
            self.batch.request_abort(job_id, AbortReason.ENDED)


async def every(
    interval_s: float, action: Callable[[], Awaitable[None]], closing: asyncio.Event
) -> None:
    """Run `action` every `interval_s` until `closing`: a side task never dies of an error."""
    while not closing.is_set():
        try:
            await action()
        except REDIS_DOWN:
            pass  # the main loop reports and backs off; try again next time
        except Exception:
            logger.exception("%s failed", getattr(action, "__name__", "side task"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(closing.wait(), interval_s)
