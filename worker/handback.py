"""Giving unfinished jobs back to the queue at shutdown, so another worker resumes them now
(instead of after the janitor's min-idle time)."""

from __future__ import annotations

from redis.asyncio import Redis

from redis_io.scripts import evalsha_command, load_command
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
        pipe.execute_command(*load_command(HANDBACK_SCRIPT))
        for held in jobs:
            script_keys = [
                held.queue_stream or jobs_stream,  # a bulk job goes back to the bulk stream
                keys.job(held.job_id),
            ]
            args = [
                keys.group,
                held.entry_id,
                held.job_id,
                "1" if held.start_confirmed else "0",
                keys.arrivals_channel(model),
            ]
            pipe.execute_command(*evalsha_command(HANDBACK_SCRIPT, script_keys, args))
        replies = await pipe.execute()
    return {held.job_id: reply for held, reply in zip(jobs, replies[1:], strict=True)}
