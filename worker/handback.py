"""Giving unfinished jobs back to the queue at shutdown, so another worker resumes them now
(instead of after the janitor's min-idle time)."""

from __future__ import annotations

from redis.asyncio import Redis

from schemas import RedisKeys
from schemas.redis_scripts import HANDBACK_SCRIPT
from worker.held import HeldJob


async def hand_back(
    redis: Redis, keys: RedisKeys, model: str, jobs: list[HeldJob]
) -> dict[str, str | None]:
    """Re-queue `model`'s `jobs` in one round trip; returns job id -> new entry id (None: job
    was over). Their published chunks stay, so whoever takes them next continues the
    numbering."""
    if not jobs:
        return {}
    jobs_stream = keys.jobs_stream(model)
    async with redis.pipeline(transaction=False) as pipe:
        for held in jobs:
            pipe.eval(
                HANDBACK_SCRIPT,
                2,
                held.queue_stream or jobs_stream,  # a bulk job goes back to the bulk stream
                keys.job(held.job_id),
                keys.group,
                held.entry_id,
                held.job_id,
                "1" if held.start_confirmed else "0",
                keys.arrivals_channel(model),
            )
        replies = await pipe.execute()
    return {held.job_id: reply for held, reply in zip(jobs, replies, strict=True)}
