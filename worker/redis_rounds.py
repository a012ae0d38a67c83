"""The worker's rounds of Redis traffic: each turn, the outbox goes out and entries are read
(concurrently, beside the engine's step), and while Redis is away a backoff says when to try
again. Redis being away never stops the engine: the outbox keeps every write in order and sends
it once Redis is back, first re-publishing the chunks a failover lost (worker.replay_log)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from redis_io.clients import master_address
from worker.backoff import Backoff
from worker.batch import Batch
from worker.control import REDIS_DOWN
from worker.engine_api import EngineLike
from worker.logs import log_event
from worker.metrics import WorkerMetrics
from worker.publisher import Outbox
from worker.pulling import EntryPuller
from worker.replay_log import refill
from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)


class RedisRounds:
    """Sends the outbox and reads entries (through `puller`) in rounds, and backs off (`backoff`)
    while Redis is away."""

    def __init__(
        self,
        settings: WorkerSettings,
        redis: Redis,
        engine: EngineLike,
        batch: Batch,
        outbox: Outbox,
        puller: EntryPuller,
        metrics: WorkerMetrics,
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self.model = settings.queue_model
        self.redis = redis
        self.engine = engine
        self.batch = batch
        self.outbox = outbox
        self.puller = puller
        self.metrics = metrics
        self.backoff = Backoff(settings.reconnect_min_s, settings.reconnect_max_s)
        self._master: tuple[str, int] | None = None  # where the last round went (Sentinels)

    async def round(self, budget: int, *, block: bool, read_new: bool = True) -> None:
        """Send the outbox and read up to `budget` entries (new ones only with `read_new`),
        concurrently. A lost connection never raises here: the backoff decides when the next
        round tries again."""
        if not self.backoff.ready():
            if block or not self.engine.has_unfinished():
                await asyncio.sleep(min(self.backoff.delay(), 0.5))
            return
        try:
            await self.refill_after_failover()
        except REDIS_DOWN as exc:
            await self.failed(exc)
            return
        results = await asyncio.gather(
            self.flush(),
            self.puller.pull(budget, block, read_new),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, Exception):
                raise failure  # cancelled, interrupted
            if isinstance(failure, ResponseError) and "NOGROUP" in str(failure):
                # Redis came back without our data (no persistence): start over.
                log_event(
                    logger,
                    logging.WARNING,
                    "consumer_group_missing",
                    stream=self.puller.reader.stream,
                )
                with contextlib.suppress(*REDIS_DOWN, ResponseError):
                    await self.puller.reader.ensure_group()
            elif not isinstance(failure, REDIS_DOWN):
                logger.error("Redis round failed", exc_info=failure)
        if failures:
            await self.failed(failures[0])
            return
        held = {h.job_id for h in self.batch.all_jobs()}
        self.outbox.keep_only(held | self.outbox.jobs_queued())
        if self.backoff.succeeded():
            log_event(logger, logging.INFO, "redis_reconnected", worker=self.name)
            self.puller.recover_pending = True  # reads cut off while Redis was away left entries

    async def refill_after_failover(self) -> None:
        """After Redis was away, or the Sentinels named another master, and before anything
        else is sent: re-publish the chunks the replay streams lost (worker.replay_log)."""
        master = master_address(self.redis)
        moved = master is not None and self._master is not None and master != self._master
        if self.backoff.failures or moved:
            self.outbox.forget_scripts()  # a new master may not have them
            sent = await refill(self.redis, self.outbox.replay, sharded=self.outbox.keys.cluster)
            if sent:
                self.metrics.chunks_republished.labels(self.model).inc(sent)
        self._master = master_address(self.redis) or master

    async def failed(self, exc: BaseException) -> None:
        """Back off before the next round. Only a lost connection is Redis being away; anything
        else is a bug here (entries that cannot be read are dead-lettered on their own), and is
        not reported as an outage."""
        wait = self.backoff.failed()
        self.metrics.redis_errors.labels(self.model).inc()
        log_event(
            logger,
            logging.WARNING,
            "redis_unavailable" if isinstance(exc, REDIS_DOWN) else "redis_round_failed",
            worker=self.name,
            error=exc,
            retry_in=f"{wait:.2f}s",
            held=len(self.batch.held),
            outbox=len(self.outbox),
        )

    async def flush(self) -> None:
        if not self.outbox.pending:
            return
        started = time.perf_counter()
        await self.outbox.flush(self.redis)
        self.metrics.flush_time.labels(self.model).observe(time.perf_counter() - started)

    async def send_first_step(self) -> None:
        """Store the starts and the first-step marker of the jobs that joined the engine
        before the engine runs them: the step that follows may kill this process, and only
        stored evidence lets the next worker charge a job with it (worker.crashes). Redis
        being away does not stop the engine for it: they then go with the next round."""
        self.batch.first_step_unsent = False
        if not self.backoff.ready():
            return
        try:
            # only what the step needs stored: the last step's results go out beside it
            await self.outbox.flush(self.redis, ahead_only=True)
        except Exception as exc:
            await self.failed(exc)

    async def read_between_steps(self) -> None:
        """New entries, read with the engine idle between two long steps, so that jobs which
        arrived during the last one join the next (see ReadPacing.read_between_steps)."""
        budget = self.batch.pull_budget(self.settings.max_pull)
        if budget <= 0 or not self.backoff.ready():
            return
        try:
            await self.puller.take_new(budget)
        except REDIS_DOWN as exc:
            await self.failed(exc)
        except ResponseError as exc:  # a new master without our group: the next round fixes it
            await self.failed(exc)
