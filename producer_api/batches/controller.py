"""The batch controller: an arq worker, off the GPU path (it only enqueues jobs and reads
results through Redis).

    arq producer_api.batches.controller.WorkerSettings      # or: inferq batch controller

Each arq job `advance_batch(batch_id)` holds the batch's lease and advances it for at most
`batch_tick_s`, then queues its successor, so no arq job runs long (a killed arq worker's job
is retried by arq once its in-progress marker lapses). Faster than that, `resume_batches` runs
at start-up and every `batch_resume_every_s`: any active batch whose lease has lapsed (its run
died) gets a new run. Runs are idempotent (see runner.py), so a batch resumed after a crash
finishes with every line exactly once."""

from __future__ import annotations

import logging
import time
from typing import Any

from arq import Retry, create_pool, cron
from arq.connections import ArqRedis, RedisSettings
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer_api.batches.lease_holder import holder_known_dead
from producer_api.batches.runner import BatchRunner, Lease
from producer_api.batches.settings import BatchControllerSettings
from producer_api.prompt_tokens import TokenizerCache
from redis_io.clients import redis_client
from redis_io.scripts import run_script
from schemas import RedisKeys
from schemas.redis_connection import RedisConnectionSettings
from schemas.redis_scripts import LEASE_RELEASE_SCRIPT

log = logging.getLogger(__name__)

ADVANCE = "advance_batch"
_MAX_TRIES = 20  # Redis blips: arq retries a run, which picks up where the last one stopped
_RESUME_CRON = "cron:resume_batches"  # arq's name of the cron job, in its log lines


NO_BATCH_QUEUE = (
    "redis_batch_queue_url: the Batch API on a Redis Cluster needs a plain Redis for the batch "
    "controller's queue (arq's transactions span keys a cluster keeps apart)"
)


async def enqueue_advance(arq: ArqRedis, keys: RedisKeys, batch_id: str, tag: str) -> None:
    """Queue a run of the batch; `tag` makes the arq job id unique per reason."""
    await arq.enqueue_job(
        ADVANCE, batch_id, _job_id=f"{batch_id}:{tag}", _queue_name=keys.arq_queue()
    )


def arq_redis_settings(settings: RedisConnectionSettings) -> RedisSettings:
    """arq's view of the same Redis: the URL's server, or the Sentinels' master; or the plain
    Redis `redis_batch_queue_url` names (a cluster cannot hold arq's queue)."""
    if settings.redis_batch_queue_url:
        return RedisSettings.from_dsn(settings.redis_batch_queue_url)
    if settings.redis_cluster:
        raise ValueError(NO_BATCH_QUEUE)
    if not settings.uses_sentinel:
        return RedisSettings.from_dsn(settings.redis_url)
    login = settings.master_login()
    return RedisSettings(
        host=settings.sentinel_addresses(),
        sentinel=True,
        sentinel_master=settings.redis_master_name,
        database=login.db,
        username=login.username,
        password=login.password,
    )


async def submit_batch(settings: RedisConnectionSettings, keys: RedisKeys, batch_id: str) -> None:
    """From the API: start the controller on a new batch (one short-lived arq connection)."""
    arq = await create_pool(arq_redis_settings(settings), default_queue_name=keys.arq_queue())
    try:
        await enqueue_advance(arq, keys, batch_id, "start")
    finally:
        await arq.aclose()


async def advance_batch(ctx: dict[str, Any], batch_id: str) -> str:
    settings: BatchControllerSettings = ctx["settings"]
    redis: Redis = ctx["inferq_redis"]
    keys: RedisKeys = ctx["keys"]
    lease = Lease(redis, keys.batch_lease(batch_id), settings.batch_lease_s)
    try:
        if not await lease.acquire():
            return "busy"  # another run holds it and will queue the next one
        try:
            runner = BatchRunner(redis, keys, settings, batch_id, ctx["tokenizers"])
            done = await runner.advance(time.monotonic() + settings.batch_tick_s, lease)
        finally:
            await lease.release()
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        log.warning("batch %s: Redis unavailable (%s); retrying", batch_id, exc)
        raise Retry(defer=min(ctx.get("job_try", 1), 10)) from exc
    if done:
        return "done"
    await enqueue_advance(ctx["redis"], keys, batch_id, f"t{time.time_ns()}")
    return "continued"


async def resume_batches(ctx: dict[str, Any]) -> int:
    """Start a run for every active batch nobody is advancing (its run died)."""
    redis: Redis = ctx["inferq_redis"]
    keys: RedisKeys = ctx["keys"]
    resumed = 0
    for batch_id in await redis.smembers(keys.active_batches()):
        lease_key = keys.batch_lease(batch_id)
        holder = await redis.get(lease_key)
        if holder is not None:
            if not holder_known_dead(holder):
                continue
            # its run's process died on this host: take the batch over now, not at the lease's end
            if not await run_script(redis, LEASE_RELEASE_SCRIPT, [lease_key], [holder]):
                continue
            log.info("batch %s: its run's controller process died; resuming now", batch_id)
        await enqueue_advance(ctx["redis"], keys, batch_id, f"r{time.time_ns()}")
        resumed += 1
    if resumed:
        log.info("resumed %d batches", resumed)
    return resumed


class QuietResumeCron(logging.Filter):
    """Drops arq's INFO lines about runs of the resume cron (a start and a finish line every
    `batch_resume_every_s`) unless arq logs at DEBUG: `resume_batches` says itself when it
    resumes something, so the lines only bury what matters."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or _RESUME_CRON not in record.getMessage():
            return True
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_resume_cron_logs() -> None:
    arq_log = logging.getLogger("arq.worker")
    if not any(isinstance(f, QuietResumeCron) for f in arq_log.filters):
        arq_log.addFilter(QuietResumeCron())


async def startup(ctx: dict[str, Any]) -> None:
    quiet_resume_cron_logs()
    settings = BatchControllerSettings()
    arq_redis_settings(settings)  # a cluster without a queue Redis: say so now, by name
    ctx["settings"] = settings
    ctx["keys"] = settings.redis_keys(settings.prefix)
    ctx["tokenizers"] = TokenizerCache()  # loaded once per controller process
    ctx["inferq_redis"] = redis_client(settings)
    await resume_batches(ctx)


async def shutdown(ctx: dict[str, Any]) -> None:
    await ctx["inferq_redis"].aclose()


def _every(seconds: int) -> set[int]:
    return set(range(0, 60, seconds))


def _controller_redis_settings(settings: RedisConnectionSettings) -> RedisSettings:
    """Where the controller's arq worker connects (read at import, so it never raises: on a
    cluster without a queue Redis, `startup` names the missing setting)."""
    try:
        return arq_redis_settings(settings)
    except ValueError:
        return RedisSettings.from_dsn(settings.redis_url)


_SETTINGS = BatchControllerSettings()


class WorkerSettings:
    """arq reads this class: `arq producer_api.batches.controller.WorkerSettings`."""

    functions = [advance_batch]
    cron_jobs = [
        cron(
            resume_batches,
            name=_RESUME_CRON,
            second=_every(_SETTINGS.batch_resume_every_s),
            run_at_startup=False,
        )
    ]
    on_startup = startup
    on_shutdown = shutdown
    redis_settings = _controller_redis_settings(_SETTINGS)
    queue_name = RedisKeys(_SETTINGS.prefix).arq_queue()
    max_tries = _MAX_TRIES
    # a run stops itself after batch_tick_s; the margin covers its last round and finalizing
    job_timeout = int(_SETTINGS.batch_tick_s) + 120
    keep_result = 60
    max_jobs = 32
