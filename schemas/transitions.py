"""Which status changes are allowed, and the arguments of the script every component uses to
make them.

    queued  -> running (a worker starts it), cancelled, expired, failed (dead letter)
    running -> running (another worker reclaimed it), succeeded, failed, cancelled, expired
    terminal statuses (succeeded, failed, cancelled, expired) never change again.
    a stored status that is no JobStatus at all (a corrupt writer) -> failed only


Always change `status` through `TRANSITION_SCRIPT` (compare-and-set inside Redis, text in
`schemas.redis_scripts`), never with a bare HSET: a worker finishing a job must not overwrite a
cancel that landed a moment earlier. Run it with `redis.eval(TRANSITION_SCRIPT, 2, *keys, *args)`
or `register_script`, using `transition_call` to build `keys` and `args`.
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

REPLACES_UNKNOWN: frozenset[JobStatus] = frozenset({JobStatus.FAILED})
"""The statuses that may overwrite a stored status that is no JobStatus value: such a job can
never run or end otherwise, so failing it is the only way out."""

UNKNOWN_STATUS_SOURCE = "?"
"""Stands for "any stored status that is no JobStatus" among the script's allowed sources."""


def can_transition(current: JobStatus, new: JobStatus) -> bool:
    return current in ALLOWED_FROM[new]


def transition_call(
    keys: RedisKeys,
    job_id: str,
    new_status: JobStatus,
    fields: Mapping[str, object] | None = None,
    *,
    ttl_s: int | None = None,
) -> tuple[list[str], list[str]]:
    """`(KEYS, ARGV)` for `schemas.redis_scripts.TRANSITION_SCRIPT`. `fields` are job-hash
    fields written along (encoded with `schemas.jobs.hash_fields`). Terminal statuses get the
    result TTL and publish a StatusEvent on the job channel by default."""
    terminal = new_status.is_terminal
    if ttl_s is None:
        ttl_s = RESULT_TTL_S if terminal else 0
    event = StatusEvent(job_id=job_id, status=new_status).to_json() if terminal else ""
    sources = " ".join(sorted(ALLOWED_FROM[new_status]))
    if new_status in REPLACES_UNKNOWN:
        sources += f" {UNKNOWN_STATUS_SOURCE}"
    args = [new_status.value, sources, str(ttl_s), event]
    for name, value in hash_fields(**dict(fields or {})).items():
        args += [name, value]
    return [keys.job(job_id), keys.channel(job_id)], args


def transition_applied(reply: list[int | str | bytes]) -> tuple[bool, JobStatus | None]:
    """Decode the script's reply: (applied, previous-or-current status; None if no such job or
    when the stored status is no JobStatus value)."""
    applied, status = reply
    text = status.decode(errors="replace") if isinstance(status, bytes) else str(status)
    return bool(int(applied)), _job_status(text)


def _job_status(text: str) -> JobStatus | None:
    try:
        return JobStatus(text)
    except ValueError:
        return None
