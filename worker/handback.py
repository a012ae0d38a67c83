"""Giving unfinished jobs back to the queue at shutdown, so another worker resumes them now
(instead of after the janitor's min-idle time)."""

from __future__ import annotations

from redis.asyncio import Redis

from schemas import RedisKeys
from worker.held import HeldJob

# Atomic per job: retire the old entry and queue a fresh one for the same job, unless the job
# ended meanwhile. A graceful hand-back is no failed attempt, so the attempt we counted when we
# started the job is given back.
HANDBACK_SCRIPT = """
-- KEYS[1] jobs stream, KEYS[2] job hash
-- ARGV[1] group, ARGV[2] entry id held, ARGV[3] job id, ARGV[4] '1': return our attempt
-- returns the new entry id, or false when the job is over (entry just retired)
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
local status = redis.call('HGET', KEYS[2], 'status')
if status ~= 'queued' and status ~= 'running' then return false end
local entry = redis.call('XADD', KEYS[1], '*', 'job', ARGV[3])
redis.call('HSET', KEYS[2], 'entry_id', entry)
if ARGV[4] == '1' and tonumber(redis.call('HGET', KEYS[2], 'attempts') or '0') > 0 then
  redis.call('HINCRBY', KEYS[2], 'attempts', -1)
end
return entry
"""


async def hand_back(
    redis: Redis, keys: RedisKeys, jobs_stream: str, jobs: list[HeldJob]
) -> dict[str, str | None]:
    """Re-queue `jobs` in one round trip; returns job id -> new entry id (None: job was over).
    Their published chunks stay, so whoever takes them next continues the numbering."""
    if not jobs:
        return {}
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
            )
        replies = await pipe.execute()
    return {held.job_id: reply for held, reply in zip(jobs, replies, strict=True)}
