"""The worker: joins one model's Redis job stream to an engine.

One asyncio loop drives everything. Each turn of the main loop:

1. with the engine idle: apply aborts (cancel, deadline, lost lease), add the jobs read last
   turn to the engine, and compute how many more jobs the free KV blocks admit;
2. run `engine.step()` in a thread while, on the loop, the outbox (chunks, status changes and
   acks of the previous step) goes out in one pipeline and up to that many entries are read;
3. turn the step's deltas into chunks and results, queued in the outbox for the next turn;
4. after a long step, read new entries now rather than beside the next step, so a job that
   arrived meanwhile joins that very step (see ReadPacing).

Where each part lives: the engine thread in worker.engine_thread, the Redis rounds (outbox out,
entries in, backoff while Redis is away) in worker.redis_rounds, what is read and what becomes
of each entry in worker.pulling, the heartbeat, listeners and lease renewal in
worker.side_tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.asyncio import Redis

from engine.outputs import EngineStats, RequestDelta
from redis_io.clients import redis_client
from redis_io.memory_check import warn_about_redis_memory
from schemas import utc_now
from worker.batch import Batch
from worker.chunk_relay import Listeners
from worker.chunking import ChunkPolicy
from worker.control import REDIS_DOWN
from worker.engine_api import EngineLike
from worker.engine_thread import EngineThread
from worker.handback import hand_back
from worker.logs import log_event
from worker.lora import AdapterRegistry, parse_lora_modules
from worker.lora_affinity import LoraAffinity
from worker.metrics import WorkerMetrics
from worker.priority import PriorityReader, ReadPacing
from worker.publisher import Outbox
from worker.pulling import EntryPuller
from worker.redis_rounds import RedisRounds
from worker.settings import WorkerSettings
from worker.shard_homes import ShardHomes
from worker.side_tasks import SideTasks
from worker.tracing import ChunkTracer

logger = logging.getLogger(__name__)


class Worker:
    """Serve `settings.queue_model` from Redis with `engine` (built from the settings if not
    given). `await run()` until `request_stop()`; then running jobs get `drain_timeout_s` to
    finish and the rest are handed back to the queue."""

    def __init__(self, settings: WorkerSettings, engine: EngineLike | None = None) -> None:
        self.settings = settings
        self.name = settings.name
        self.model = settings.queue_model
        self.keys = settings.redis_keys(settings.prefix)
        self.jobs_stream = self.keys.jobs_stream(self.model)
        self._engine_thread = EngineThread()
        self.engine = engine if engine is not None else self._engine_thread.build(settings)
        self.redis = self._connect(decode=True)
        # interactive jobs stream first, the bulk stream with the room left; its own
        # connections, which leave decoding to it (see StreamReader)
        self.intake_redis = self._connect(decode=False)
        self.reader = PriorityReader(self.intake_redis, self.keys, self.model, self.name)
        self.homes: ShardHomes | None = None
        if self.keys.cluster:
            self.homes = ShardHomes(self.redis, self.keys, self.model, self.name)
            self.reader.homes = self.homes
        self.outbox = Outbox(
            self.keys,
            self.jobs_stream,
            self.name,
            replicas=settings.replica_wait(),
            listeners=Listeners(look_interval_s=settings.chunk_interval_ms / 1000),
        )
        self.metrics = WorkerMetrics(self.model)
        self.tracer = ChunkTracer(settings.chunk_trace_path)
        self.batch = Batch(
            self.engine,
            self.outbox,
            worker_name=self.name,
            policy=ChunkPolicy(
                settings.chunk_tokens,
                settings.chunk_interval_ms / 1000,
                settings.chunk_unwatched_ms / 1000,
            ),
            metrics=self.metrics,
            tracer=self.tracer,
            prompt_estimate=settings.admission_prompt_tokens,
            lora=AdapterRegistry(parse_lora_modules(settings.lora_modules)),
        )
        affinity = None
        if settings.lora_enabled and settings.lora_affinity_wait_s > 0:
            affinity = LoraAffinity(
                self.intake_redis,
                self.keys,
                self.model,
                self.name,
                settings.lora_affinity_wait_s,
                resident=lambda: self.batch.lora.names_of(self.stats.lora_resident),
            )
        self.puller = EntryPuller(
            settings,
            self.reader,
            self.batch,
            self.outbox,
            stopping=lambda: self._stop_requested,
            affinity=affinity,
        )
        self.rounds = RedisRounds(
            settings, self.redis, self.engine, self.batch, self.outbox, self.puller, self.metrics
        )
        self.metrics_port: int | None = None
        self.stats: EngineStats = self.engine.stats()
        self.started_at = utc_now()
        self.side_tasks = SideTasks(
            settings,
            self.redis,
            self.engine,
            self.batch,
            current_stats=lambda: self.stats,
            on_arrival=self.puller.note_arrival,
            started_at=self.started_at,
            held_jobs=self.puller.held_jobs,
            homes=self.homes,
        )
        self._stop_requested = False
        self._drain_deadline = float("inf")
        self._last_step_end: float | None = None  # engine thread's clock, while the batch runs

    def _connect(self, *, decode: bool) -> Redis:
        settings = self.settings
        return redis_client(
            settings,
            decode_responses=decode,
            socket_timeout=settings.socket_timeout_s + settings.block_ms / 1000,
            socket_connect_timeout=min(settings.socket_timeout_s, 5.0),
        )

    @property
    def outcomes(self) -> dict[str, int]:
        """How many jobs ended how (succeeded, failed, cancelled, ...), for logs and tests."""
        return self.batch.outcomes

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self, drain_timeout_s: float | None = None) -> None:
        """Stop pulling; running jobs get the drain timeout, then are handed back. A second
        call ends the drain at once."""
        timeout = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if self._stop_requested:
            timeout = 0.0
        self._stop_requested = True
        self._drain_deadline = min(self._drain_deadline, time.monotonic() + timeout)
        log_event(logger, logging.INFO, "worker_stopping", worker=self.name, drain_s=timeout)

    async def run(self) -> None:
        if self.settings.metrics_port is not None:
            self.metrics_port = self.metrics.serve(
                self.settings.metrics_port, self.settings.metrics_host
            )
        tasks: list[asyncio.Task[None]] = []
        closing = asyncio.Event()
        try:
            if not await self._create_group():
                return
            await warn_about_redis_memory(
                self.redis,
                on_unsafe=lambda problem: log_event(
                    logger, logging.WARNING, "redis_memory_unsafe", problem=problem
                ),
                on_unchecked=lambda exc: log_event(
                    logger, logging.INFO, "redis_memory_unchecked", error=exc
                ),
            )
            tasks = [asyncio.create_task(task) for task in self.side_tasks.all(closing)]
            log_event(
                logger,
                logging.INFO,
                "worker_started",
                worker=self.name,
                model=self.model,
                stream=self.jobs_stream,
                kv_blocks=self.stats.num_blocks_total,
                quantization=self.engine.quantization or "none",
                weight_mib=round(self.engine.weight_bytes / 2**20, 1),
            )
            await self._main_loop()
            await self._hand_back_unfinished()
        finally:
            closing.set()
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5.0)
            await self._goodbye()
        log_event(logger, logging.INFO, "worker_stopped", worker=self.name, **self.outcomes)

    async def _create_group(self) -> bool:
        """Create the consumer group, waiting for Redis as long as it takes (False: stopped
        before Redis came up)."""
        while not self._stop_requested:
            try:
                await self.reader.ensure_group()
                return True
            except REDIS_DOWN as exc:
                await self.rounds.failed(exc)
                await asyncio.sleep(self.rounds.backoff.delay())
        return False

    async def _goodbye(self) -> None:
        with contextlib.suppress(TimeoutError, *REDIS_DOWN):
            await asyncio.wait_for(self.redis.delete(self.keys.worker(self.name)), 2.0)
            if self.homes is not None:
                await asyncio.wait_for(self.homes.leave(), 2.0)
        self.metrics.close()
        self.tracer.close()
        self._engine_thread.shutdown()
        await self.redis.aclose()
        await self.intake_redis.aclose()

    # ------------------------------------------------------------------ the main loop

    async def _main_loop(self) -> None:
        while True:
            self.batch.prepare_turn()
            self.stats = self.engine.stats()
            self.metrics.observe_stats(self.stats)
            busy = self.engine.has_unfinished()
            if self._stop_requested and (not busy or time.monotonic() >= self._drain_deadline):
                return
            budget = 0 if self._stop_requested else self.batch.pull_budget(self.settings.max_pull)
            if busy and self.batch.first_step_unsent:
                await self.rounds.send_first_step()
                continue
            if busy:
                turn_started = time.perf_counter()
                step = asyncio.create_task(self._step())
                try:
                    await self.rounds.round(
                        budget, block=False, read_new=self.puller.may_have_new()
                    )
                finally:
                    deltas, error, emitted_at = await step
                self.batch.collect(deltas, error, emitted_at)
                turn_s = time.perf_counter() - turn_started  # how long new jobs went unread
                if (
                    not self._stop_requested
                    and ReadPacing.read_between_steps(turn_s)
                    and self.puller.may_have_new()
                ):
                    await self.rounds.read_between_steps()
            else:  # idle: wait for work (the outbox goes out meanwhile)
                self._last_step_end = None  # the wait for new jobs is no handoff
                await self.rounds.round(budget, block=True)

    async def _step(self) -> tuple[list[RequestDelta], BaseException | None, float]:
        try:
            deltas, began, ended = await self._engine_thread.step(self.engine)
        except Exception as exc:  # an engine bug: the batch fails, the worker serves on
            self._last_step_end = None
            return [], exc, time.time()
        self.metrics.step_time.labels(self.model).observe(ended - began)
        if self._last_step_end is not None:
            self.metrics.engine_wait.labels(self.model).observe(began - self._last_step_end)
        self._last_step_end = ended
        return deltas, None, time.time()

    # ------------------------------------------------------------------ shutdown

    async def _hand_back_unfinished(self) -> None:
        """Publish what unfinished jobs produced so far, then re-queue them for another worker."""
        try:
            await self.puller.release_offered()
        except REDIS_DOWN as exc:  # offers left pending here go to the janitors with the worker
            log_event(logger, logging.WARNING, "lora_offers_kept", worker=self.name, error=exc)
        jobs = self.batch.release_for_hand_back()
        give_up = time.monotonic() + max(5.0, self.settings.drain_timeout_s)
        while True:
            try:
                await self.rounds.refill_after_failover()
                await self.outbox.flush(self.redis)
                requeued = await hand_back(self.redis, self.keys, self.model, jobs)
                break
            except REDIS_DOWN as exc:
                if time.monotonic() >= give_up:  # the janitors take them after the lease ends
                    log_event(
                        logger,
                        logging.ERROR,
                        "hand_back_failed",
                        worker=self.name,
                        jobs=len(jobs),
                        error=exc,
                    )
                    return
                await self.rounds.failed(exc)
                await asyncio.sleep(self.rounds.backoff.delay())
        for job_id, entry in requeued.items():
            log_event(logger, logging.INFO, "job_handed_back", job=job_id, new_entry=entry)
        self.batch.count("handed_back", len(jobs))
