"""Refilling replay streams that lost their tail.

Replication is asynchronous: chunks a master acknowledged may not have reached the replica
that a failover promotes. The new master's replay stream of a running job then ends early,
and a client that resumes from it would never see the chunks in between (explicit ids only
grow, so once a later chunk is added the gap can never be filled). So the worker keeps the
chunks Redis acknowledged for every job still in its hands, and after a reconnect (or a change
of master), before anything else is sent, re-publishes what each replay stream lacks; the
outbox then sends the chunks never acknowledged, as always. Live
listeners skip the repeated PUBLISHes by chunk index: every chunk number reaches every client
exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from redis.asyncio import Redis

from schemas import OUT_STREAM_MAXLEN, OUT_STREAM_TTL_S, chunk_index_from_stream_id
from schemas.chunks import REPLAY_FIELD, ChunkWrite
from worker.chunk_relay import check_chunk_replies, chunk_commands
from worker.logs import log_event

logger = logging.getLogger(__name__)


@dataclass
class ReplayLog:
    """The chunks Redis acknowledged for each job this worker still holds, in index order."""

    _by_job: dict[str, list[ChunkWrite]] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(writes) for writes in self._by_job.values())

    def record(self, write: ChunkWrite) -> None:
        self._by_job.setdefault(write.job_id, []).append(write)

    def keep_only(self, job_ids: Iterable[str]) -> None:
        """Forget the jobs not in `job_ids` (they left this worker: done, handed back, lost)."""
        keep = set(job_ids)
        for job_id in [j for j in self._by_job if j not in keep]:
            del self._by_job[job_id]

    def streams(self) -> dict[str, str]:
        """job id -> its replay stream, for every job with logged chunks."""
        return {job_id: writes[0].out_stream for job_id, writes in self._by_job.items() if writes}

    def after(self, job_id: str, last_index: int) -> list[ChunkWrite]:
        return [w for w in self._by_job.get(job_id, []) if w.index > last_index]


async def refill(
    redis: Redis,
    log: ReplayLog,
    maxlen: int = OUT_STREAM_MAXLEN,
    ttl_s: int = OUT_STREAM_TTL_S,
    field_name: str = REPLAY_FIELD,
    sharded: bool = False,
) -> int:
    """Re-publish every logged chunk its replay stream lacks (two round trips; live too, as
    who listens is not known on a new master; SPUBLISH when `sharded`); returns how many chunks went out again."""
    streams = log.streams()
    if not streams:
        return 0
    async with redis.pipeline(transaction=False) as pipe:
        for job_id in streams:
            pipe.xrevrange(streams[job_id], "+", "-", count=1)
        tops = await pipe.execute()
    missing: list[ChunkWrite] = []
    for job_id, top in zip(streams, tops, strict=True):
        last = chunk_index_from_stream_id(top[0][0]) if top else -1
        missing += log.after(job_id, last)
    if not missing:
        return 0
    jobs = len({write.job_id for write in missing})
    log_event(logger, logging.WARNING, "replay_streams_refilled", jobs=jobs, chunks=len(missing))
    async with redis.pipeline(transaction=False) as pipe:
        for write in missing:
            again = replace(write, set_ttl=True)
            for command in chunk_commands(
                again,
                publish=True,
                maxlen=maxlen,
                ttl_s=ttl_s,
                field_name=field_name,
                sharded=sharded,
            ):
                pipe.execute_command(*command)
        check_chunk_replies(await pipe.execute(raise_on_error=False))
    return len(missing)
