"""The worker: joins one model's Redis job stream to an engine.

One asyncio loop drives everything. Each turn of the main loop:

1. with the engine idle: apply aborts (cancel, deadline, lost lease), add the jobs read last
   turn to the engine, and compute how many more jobs the free KV blocks admit;
2. run `engine.step()` in a thread while, on the loop, the outbox (chunks, status changes and
   acks of the previous step) goes out in one pipeline and up to that many entries are read;
3. turn the step's deltas into chunks and results, queued in the outbox for the next turn;
4. after a long step, read new entries now rather than beside the next step, so a job that
   arrived meanwhile joins that very step (see ReadPacing).

A busy worker reads new entries only when its model's arrivals channel said something came (or
its last read filled the budget), and otherwise every UNPROMPTED_READ_S, for producers that
do not publish: with nothing new, a step costs no read at all.

Side tasks: heartbeat, cancel and arrivals listener, lease renewal, status checks. Redis being
away never stops the engine: the outbox keeps every write in order and sends it once Redis is
back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from engine.outputs import EngineStats, RequestDelta
from redis_io.clients import master_address, redis_client
from redis_io.memory_check import warn_about_redis_memory
from schemas import (
    OUT_STREAM_MAXLEN,
    OUT_STREAM_TTL_S,
    ErrorBody,
    ErrorCode,
    JobField,
    JobStatus,
    RedisKeys,
    utc_now,
)
from schemas.chunks import REPLAY_FIELD
from worker.backoff import Backoff
from worker.batch import AbortReason, Batch
from worker.chunking import ChunkPolicy
from worker.control import REDIS_DOWN, ended_jobs, listen
from worker.crashes import CrashPolicy
from worker.engine_api import EngineLike, build_engine
from worker.handback import hand_back
from worker.heartbeat import beat
from worker.intake import Admit, Entry, Expire, Reject, Skip, Verdict
from worker.janitor import renew_leases
from worker.logs import log_event
from worker.metrics import WorkerMetrics
from worker.priority import PriorityReader, ReadPacing
from worker.publisher import Outbox
from worker.replay_log import refill
from worker.settings import WorkerSettings
from worker.tracing import ChunkTracer

logger = logging.getLogger(__name__)

# How long the loop waits, at most, for the engine thread to begin a step it was handed.
STEP_START_WAIT_S = 0.005
# A busy worker with no notice of new entries still reads this often: an entry whose notice was
# lost (or that a producer added without one) waits at most this much longer.
UNPROMPTED_READ_S = 0.25


class Worker:
    """Serve `settings.queue_model` from Redis with `engine` (built from the settings if not
    given). `await run()` until `request_stop()`; then running jobs get `drain_timeout_s` to
    finish and the rest are handed back to the queue."""

    def __init__(self, settings: WorkerSettings, engine: EngineLike | None = None) -> None:
        self.settings = settings
        self.name = settings.name
        self.model = settings.queue_model
        self.keys = RedisKeys(settings.prefix)
        self.jobs_stream = self.keys.jobs_stream(self.model)
        # One thread builds the engine and runs every step: the engine is not thread-safe, and
        # libgomp gives each thread that runs torch ops its own OpenMP team. Two teams (say, one
        # from loading the model on this thread, one stepping) hold more OpenMP threads than
        # there are cores, and libgomp then all but stops spin-waiting: every parallel region
        # of a step wakes its threads through the kernel, ~7-10% of step time on 2 cores.
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        if engine is None:
            try:
                engine = self._engine_thread.submit(build_engine, settings).result()
            except BaseException:
                self._engine_thread.shutdown(wait=False)
                raise
        self.engine = engine
        self.redis = self._connect(decode=True)
        # interactive jobs stream first, the bulk stream with the room left; its own
        # connections, which leave decoding to it (see StreamReader)
        self.intake_redis = self._connect(decode=False)
        self.reader = PriorityReader(self.intake_redis, self.keys, self.model, self.name)
        self.pacing = ReadPacing(settings.bulk_max_held, self.reader.bulk_stream)
        self.crash_policy = CrashPolicy(settings.max_attempts, settings.max_crash_resumes)
        self.outbox = Outbox(
            self.keys, self.jobs_stream, self.name, replicas=settings.replica_wait()
        )
        self.metrics = WorkerMetrics(self.model)
        self.tracer = ChunkTracer(settings.chunk_trace_path)
        self.batch = Batch(
            self.engine,
            self.outbox,
            worker_name=self.name,
            policy=ChunkPolicy(settings.chunk_tokens, settings.chunk_interval_ms / 1000),
            metrics=self.metrics,
            tracer=self.tracer,
            prompt_estimate=settings.admission_prompt_tokens,
        )
        self.metrics_port: int | None = None
        self.stats: EngineStats = self.engine.stats()
        self.started_at = utc_now()
        self._redis = Backoff(settings.reconnect_min_s, settings.reconnect_max_s)
        self._control = Backoff(settings.reconnect_min_s, settings.reconnect_max_s)
        self._stop_requested = False
        self._drain_deadline = float("inf")
        self._next_janitor = 0.0
        self._recover_pending = True  # read our own pending entries first
        self._master: tuple[str, int] | None = None  # where the last round went (Sentinels)
        self._last_step_end: float | None = None  # engine thread's clock, while the batch runs
        self._step_began = threading.Event()  # set by the engine thread as it begins a step
        self._arrivals = True  # new entries may be waiting (a notice, or the last read was full)
        self._next_unprompted_read = 0.0  # monotonic

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
            settings = self.settings
            side_tasks = [
                self._every(settings.heartbeat_interval_s, self._beat, closing),
                listen(
                    self.redis,
                    self.keys,
                    self.model,
                    self._on_cancel,
                    self._on_arrival,
                    self._control,
                    closing,
                ),
                self._every(settings.lease_interval_s, self._renew_leases, closing),
                self._every(settings.status_check_interval_s, self._check_statuses, closing),
            ]
            tasks = [asyncio.create_task(side_task) for side_task in side_tasks]
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
                await self._redis_failed(exc)
                await asyncio.sleep(self._redis.delay())
        return False

    async def _goodbye(self) -> None:
        with contextlib.suppress(TimeoutError, *REDIS_DOWN):
            await asyncio.wait_for(self.redis.delete(self.keys.worker(self.name)), 2.0)
        self.metrics.close()
        self.tracer.close()
        self._engine_thread.shutdown(wait=True)
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
            if busy and self.batch.quarantine_start_unsent:
                await self._send_quarantine_start()
                continue
            if busy:
                turn_started = time.perf_counter()
                step = asyncio.create_task(self._step())
                try:
                    await self._redis_round(budget, block=False, read_new=self._may_have_new())
                finally:
                    deltas, error, emitted_at = await step
                self.batch.collect(deltas, error, emitted_at)
                turn_s = time.perf_counter() - turn_started  # how long new jobs went unread
                if (
                    not self._stop_requested
                    and self.pacing.read_between_steps(turn_s)
                    and self._may_have_new()
                ):
                    await self._read_between_steps()
            else:  # idle: wait for work (the outbox goes out meanwhile)
                self._last_step_end = None  # the wait for new jobs is no handoff
                await self._redis_round(budget, block=True)

    async def _step(self) -> tuple[list[RequestDelta], BaseException | None, float]:
        try:
            loop = asyncio.get_running_loop()
            self._step_began.clear()
            running = loop.run_in_executor(self._engine_thread, self._timed_engine_step)
            # Blocking the loop until the engine thread holds the GIL lets the step begin at
            # once: otherwise it waits behind the Python of the Redis round that comes next.
            self._step_began.wait(STEP_START_WAIT_S)
            timed = await running
        except Exception as exc:  # an engine bug: the batch fails, the worker serves on
            self._last_step_end = None
            return [], exc, time.time()
        deltas, began, ended = timed
        self.metrics.step_time.labels(self.model).observe(ended - began)
        if self._last_step_end is not None:
            self.metrics.engine_wait.labels(self.model).observe(began - self._last_step_end)
        self._last_step_end = ended
        return deltas, None, time.time()

    def _timed_engine_step(self) -> tuple[list[RequestDelta], float, float]:
        """On the engine thread: a step's deltas, and when it began and ended there (the loop's
        own timing would add the thread handoffs to the step)."""
        began = time.perf_counter()
        self._step_began.set()
        deltas = self.engine.step()
        return deltas, began, time.perf_counter()

    async def _redis_round(self, budget: int, *, block: bool, read_new: bool = True) -> None:
        """Send the outbox and read up to `budget` entries (new ones only with `read_new`),
        concurrently. A lost connection never raises here: the backoff decides when the next
        round tries again."""
        if not self._redis.ready():
            if block or not self.engine.has_unfinished():
                await asyncio.sleep(min(self._redis.delay(), 0.5))
            return
        try:
            await self._refill_after_failover()
        except REDIS_DOWN as exc:
            await self._redis_failed(exc)
            return
        results = await asyncio.gather(
            self._flush(), self._pull(budget, block, read_new), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, Exception):
                raise failure  # cancelled, interrupted
            if isinstance(failure, ResponseError) and "NOGROUP" in str(failure):
                # Redis came back without our data (no persistence): start over.
                log_event(
                    logger, logging.WARNING, "consumer_group_missing", stream=self.jobs_stream
                )
                with contextlib.suppress(*REDIS_DOWN, ResponseError):
                    await self.reader.ensure_group()
            elif not isinstance(failure, REDIS_DOWN):
                logger.error("Redis round failed", exc_info=failure)
        if failures:
            await self._redis_failed(failures[0])
            return
        held = {h.job_id for h in self.batch.all_jobs()}
        self.outbox.replay.keep_only(held | self.outbox.jobs_queued())
        if self._redis.succeeded():
            log_event(logger, logging.INFO, "redis_reconnected", worker=self.name)
            self._recover_pending = True  # reads cut off while Redis was away left entries

    async def _refill_after_failover(self) -> None:
        """After Redis was away, or the Sentinels named another master, and before anything
        else is sent: re-publish the chunks the replay streams lost (worker.replay_log)."""
        master = master_address(self.redis)
        moved = master is not None and self._master is not None and master != self._master
        if self._redis.failures or moved:
            sent = await refill(
                self.redis, self.outbox.replay, OUT_STREAM_MAXLEN, OUT_STREAM_TTL_S, REPLAY_FIELD
            )
            if sent:
                self.metrics.chunks_republished.labels(self.model).inc(sent)
        self._master = master_address(self.redis) or master

    async def _redis_failed(self, exc: BaseException) -> None:
        """Back off before the next round. Only a lost connection is Redis being away; anything
        else is a bug here (entries that cannot be read are dead-lettered on their own), and is
        not reported as an outage."""
        wait = self._redis.failed()
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

    async def _flush(self) -> None:
        if not self.outbox.ops:
            return
        started = time.perf_counter()
        await self.outbox.flush(self.redis)
        self.metrics.flush_time.labels(self.model).observe(time.perf_counter() - started)

    async def _pull(self, budget: int, block: bool, read_new: bool) -> None:
        entries: list[Entry] = []
        if self._recover_pending and not self._stop_requested:
            entries = self._not_held(await self.reader.read_own_pending())
            self._recover_pending = False
        if budget > 0 and time.monotonic() >= self._next_janitor:
            self._next_janitor = time.monotonic() + self.settings.janitor_every_s
            claimed = self._not_held(
                await self.reader.autoclaim(self.settings.claim_min_idle_ms, budget)
            )
            if claimed:
                log_event(
                    logger, logging.INFO, "entries_claimed", worker=self.name, count=len(claimed)
                )
            entries += claimed
        if read_new and budget - len(entries) > 0:
            wait_ms = self.settings.block_ms if block and not entries else None
            entries += await self._read_new(budget - len(entries), wait_ms)
        elif block and not entries:
            await asyncio.sleep(self.settings.block_ms / 1000)
        if entries:
            self._take(await self.reader.load(entries, self.crash_policy, utc_now()))

    async def _send_quarantine_start(self) -> None:
        """Store a quarantined job's start before the engine runs it: the step that follows
        may kill this process, and only a stored start lets the next worker charge the job
        with it (otherwise the start is sent concurrently with the step). Redis being away
        does not stop the engine for it: the start then goes with the next round."""
        self.batch.quarantine_start_unsent = False
        if not self._redis.ready():
            return
        try:
            await self._flush()
        except Exception as exc:
            await self._redis_failed(exc)

    async def _read_between_steps(self) -> None:
        """New entries, read with the engine idle between two long steps, so that jobs which
        arrived during the last one join the next (see ReadPacing.read_between_steps)."""
        budget = self.batch.pull_budget(self.settings.max_pull)
        if budget <= 0 or not self._redis.ready():
            return
        try:
            entries = self._not_held(await self._read_new(budget, None))
            if entries:
                self._take(await self.reader.load(entries, self.crash_policy, utc_now()))
        except REDIS_DOWN as exc:
            await self._redis_failed(exc)
        except ResponseError as exc:  # a new master without our group: the next round fixes it
            await self._redis_failed(exc)

    def _may_have_new(self) -> bool:
        return self._arrivals or time.monotonic() >= self._next_unprompted_read

    async def _read_new(self, count: int, wait_ms: int | None) -> list[Entry]:
        """Up to `count` new entries (see PriorityReader.read_new); notices that come while it
        runs count for the next read."""
        self._arrivals = False
        self._next_unprompted_read = time.monotonic() + UNPROMPTED_READ_S
        try:
            entries = await self.reader.read_new(
                count, wait_ms, self.pacing.bulk_room(self.batch.all_jobs())
            )
        except BaseException:
            self._arrivals = True
            raise
        if len(entries) >= count:
            self._arrivals = True  # more may be waiting
        return entries

    def _not_held(self, entries: list[Entry]) -> list[Entry]:
        mine = {h.entry_id for h in self.batch.all_jobs()} | self.outbox.entries_being_acked()
        return [entry for entry in entries if entry.entry_id not in mine]

    def _take(self, verdicts: list[Verdict]) -> None:
        for verdict in verdicts:
            if isinstance(verdict, Admit):
                self.batch.queue(verdict.held)
            elif isinstance(verdict, Skip):
                log_event(
                    logger,
                    logging.INFO,
                    "entry_skipped",
                    job=verdict.job_id,
                    entry=verdict.entry_id,
                    reason=verdict.reason,
                )
                self.outbox.ack(verdict.entry_id, verdict.stream)
            elif isinstance(verdict, Expire):
                error = ErrorBody.of(
                    ErrorCode.EXPIRED, "the deadline passed before the job started"
                )
                self.outbox.finish(
                    verdict.job_id,
                    verdict.entry_id,
                    JobStatus.EXPIRED,
                    {JobField.ERROR: error},
                    stream=verdict.stream,
                )
                self.batch.count("expired")
            elif isinstance(verdict, Reject):
                self.batch.reject(verdict)

    # ------------------------------------------------------------------ side tasks

    def _on_cancel(self, job_id: str) -> None:
        self.batch.request_abort(job_id, AbortReason.ENDED)

    def _on_arrival(self) -> None:
        self._arrivals = True

    async def _every(
        self, interval_s: float, action: Callable[[], Awaitable[None]], closing: asyncio.Event
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

    async def _beat(self) -> None:
        ttfts = self.batch.ttfts.take()
        try:
            await beat(
                self.redis,
                self.keys,
                name=self.name,
                model=self.model,
                stats=self.stats,
                started_at=self.started_at,
                ttl_s=self.settings.heartbeat_ttl_s,
                max_model_len=self.engine.max_model_len,
                vocab_size=self.engine.vocab_size,
                tokenizer_file=self.engine.tokenizer_file,
                quantization=self.engine.quantization,
                weight_bytes=self.engine.weight_bytes,
                ttfts=ttfts,
            )
        except BaseException:
            self.batch.ttfts.put_back(ttfts)  # written with the next beat
            raise

    async def _renew_leases(self) -> None:
        by_stream: dict[str, dict[str, str]] = {}
        for h in self.batch.all_jobs():
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

    async def _hand_back_unfinished(self) -> None:
        """Publish what unfinished jobs produced so far, then re-queue them for another worker."""
        jobs = self.batch.release_for_hand_back()
        give_up = time.monotonic() + max(5.0, self.settings.drain_timeout_s)
        while True:
            try:
                await self._refill_after_failover()
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
                await self._redis_failed(exc)
                await asyncio.sleep(self._redis.delay())
        for job_id, entry in requeued.items():
            log_event(logger, logging.INFO, "job_handed_back", job=job_id, new_entry=entry)
        self.batch.count("handed_back", len(jobs))
