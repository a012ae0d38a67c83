"""What a worker hears from elsewhere: cancel broadcasts on the control channel (with a periodic
look at the held jobs' statuses, in case a broadcast was missed), and notices of new entries on
its model's arrivals channel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from redis_io.clients import CLUSTER_AWAY
from redis_io.pubsub import broadcast_pubsub
from schemas import ControlMessage, JobField, JobStatus, RedisKeys
from worker.backoff import Backoff
from worker.logs import log_event

logger = logging.getLogger(__name__)

# Redis away: down, unreachable, (plain URL) a master a failover demoted, which answers READONLY,
# or (cluster) a shard without a primary while its replica takes over
REDIS_DOWN = (
    *CLUSTER_AWAY,
    RedisConnectionError,
    RedisTimeoutError,
    RedisReadOnlyError,
    ConnectionError,
    TimeoutError,
    OSError,
)


async def listen(
    redis: Redis,
    keys: RedisKeys,
    model: str,
    on_cancel: Callable[[str], None],
    on_arrival: Callable[[], None],
    on_lora_change: Callable[[], None],
    backoff: Backoff,
    closing: asyncio.Event,
) -> None:
    """Call `on_cancel(job_id)` for every cancel broadcast, `on_lora_change()` when `model`'s
    LoRA registry changed, and `on_arrival()` for every new entry of `model`'s streams until `closing` is set; re-subscribes after Redis comes back
    (broadcasts sent meanwhile are caught by `ended_jobs`; for arrivals, `on_arrival()` is called
    on every subscribe). Ends on the event rather than relying on task cancellation, which a
    timeout firing at the same moment can swallow."""
    channel = keys.control_channel()
    arrivals = keys.arrivals_channel(model)
    while not closing.is_set():
        pubsub = None
        try:
            pubsub = await broadcast_pubsub(redis, ignore_subscribe_messages=True)
            await pubsub.subscribe(channel, arrivals)
            backoff.succeeded()
            on_arrival()  # whatever was published while unsubscribed went unheard
            while not closing.is_set():
                message = await pubsub.get_message(timeout=0.5)
                if message is None or message.get("type") != "message":
                    continue
                if message["channel"] == arrivals:
                    on_arrival()
                    continue
                try:
                    control = ControlMessage.from_json(message["data"])
                except ValidationError:
                    log_event(logger, logging.WARNING, "bad_control_message", data=message["data"])
                    continue
                if control.op == "cancel" and control.job_id is not None:
                    on_cancel(control.job_id)
                elif control.op == "lora" and control.model == model:
                    on_lora_change()
        except REDIS_DOWN as exc:
            wait = backoff.failed()
            log_event(
                logger, logging.WARNING, "control_channel_lost", error=exc, retry_in=f"{wait:.2f}"
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), wait)
        finally:
            if pubsub is not None:
                with contextlib.suppress(*REDIS_DOWN):
                    await pubsub.aclose()


async def ended_jobs(
    redis: Redis, keys: RedisKeys, job_ids: list[str]
) -> dict[str, JobStatus | None]:
    """The held jobs whose hash says they are over (or whose hash is gone), with that status."""
    if not job_ids:
        return {}
    async with redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(keys.job(job_id), JobField.STATUS)
        statuses = await pipe.execute()
    out: dict[str, JobStatus | None] = {}
    for job_id, status in zip(job_ids, statuses, strict=True):
        if status is None:
            out[job_id] = None
            continue
        try:
            parsed = JobStatus(status)
        except ValueError:
            continue
        if parsed.is_terminal:
            out[job_id] = parsed
    return out
