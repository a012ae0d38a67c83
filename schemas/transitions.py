"""Which status changes are allowed, and the Lua script every component uses to make them.

    queued  -> running (a worker starts it), cancelled, expired, failed (dead letter)
    running -> running (another worker reclaimed it), succeeded, failed, cancelled, expired
    terminal statuses (succeeded, failed, cancelled, expired) never change again.

Always change `status` through `TRANSITION_SCRIPT` (compare-and-set inside Redis), never with a
bare HSET: a worker finishing a job must not overwrite a cancel that landed a moment earlier.
The script lives here as plain text so `schemas` stays free of Redis clients; run it with
`redis.eval(TRANSITION_SCRIPT, 2, *keys, *args)` or `register_script`, using
`transition_call` to build `keys` and `args`.
"""

from __future__ import annotations

from collections.abc import Mapping

from schemas.events import StatusEvent
from schemas.jobs import JobStatus, hash_fields
from schemas.keys import RESULT_TTL_S, RedisKeys

ALLOWED_FROM: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset(),
    JobStatus.RUNNING: frozenset({JobStatus.QUEUED, JobStatus.RUNNING}),
    JobStatus.SUCCEEDED: frozenset({JobStatus.RUNNING}),
    JobStatus.FAILED: frozenset({JobStatus.QUEUED, JobStatus.RUNNING}),
    JobStatus.CANCELLED: frozenset({JobStatus.QUEUED, JobStatus.RUNNING}),
    JobStatus.EXPIRED: frozenset({JobStatus.QUEUED, JobStatus.RUNNING}),
}


def can_transition(current: JobStatus, new: JobStatus) -> bool:
    return current in ALLOWED_FROM[new]


TRANSITION_SCRIPT = """
-- KEYS[1] job hash, KEYS[2] job channel
-- ARGV[1] new status
-- ARGV[2] statuses the job may be in now, separated by spaces
-- ARGV[3] TTL in seconds to set on the hash when applied (0: leave as is)
-- ARGV[4] message to PUBLISH on KEYS[2] when applied ('' : none)
-- ARGV[5..] field, value pairs written together with the status
-- returns {1, previous status} when applied, else {0, current status or '' if no such job}
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return {0, ''} end
local allowed = false
for s in string.gmatch(ARGV[2], '%S+') do
  if s == current then allowed = true break end
end
if not allowed then return {0, current} end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
for i = 5, #ARGV - 1, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
if ARGV[4] ~= '' then redis.call('PUBLISH', KEYS[2], ARGV[4]) end
return {1, current}
"""


def transition_call(
    keys: RedisKeys,
    job_id: str,
    new_status: JobStatus,
    fields: Mapping[str, object] | None = None,
    *,
    ttl_s: int | None = None,
) -> tuple[list[str], list[str]]:
    """`(KEYS, ARGV)` for TRANSITION_SCRIPT. `fields` are job-hash fields written along (encoded
    with `schemas.jobs.hash_fields`). Terminal statuses get the result TTL and publish a
    StatusEvent on the job channel by default."""
    terminal = new_status.is_terminal
    if ttl_s is None:
        ttl_s = RESULT_TTL_S if terminal else 0
    event = StatusEvent(job_id=job_id, status=new_status).to_json() if terminal else ""
    sources = " ".join(sorted(ALLOWED_FROM[new_status]))
    args = [new_status.value, sources, str(ttl_s), event]
    for name, value in hash_fields(**dict(fields or {})).items():
        args += [name, value]
    return [keys.job(job_id), keys.channel(job_id)], args


def transition_applied(reply: list[int | str | bytes]) -> tuple[bool, JobStatus | None]:
    """Decode the script's reply: (applied, previous-or-current status; None if no such job)."""
    applied, status = reply
    text = status.decode() if isinstance(status, bytes) else str(status)
    return bool(int(applied)), (JobStatus(text) if text else None)
