"""The outbox: Redis writes queued in order and sent as one pipelined round trip per step.

Every write here is safe to send twice (a pipeline cut off by a lost connection is re-sent
whole): chunk XADDs use explicit ids, which Redis refuses to repeat; status changes are
compare-and-set; XACK / XDEL of a gone entry are no-ops. Live listeners skip repeated PUBLISHes
by chunk index."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from redis_io.clients import raise_for_cluster_outage
from redis_io.replica_wait import fell_short, wait_command
from schemas import (
    OUT_STREAM_MAXLEN,
    OUT_STREAM_TTL_S,
    TRANSITION_SCRIPT,
    ErrorBody,
    JobField,
    JobStatus,
    RedisKeys,
    TokenChunk,
    chunk_stream_id,
    format_time,
    transition_applied,
    transition_call,
    utc_now,
)
from schemas.chunks import REPLAY_FIELD, ChunkWrite
from schemas.keys import DEAD_LETTER_MAXLEN, FIRST_STEP_TTL_S, JOB_ENTRY_FIELD
from schemas.redis_connection import ReplicaWait
from schemas.redis_scripts import chunk_script_calls, job_channel_script
from worker.logs import log_event
from worker.replay_log import ReplayLog

logger = logging.getLogger(__name__)

Reply = Callable[[list[Any]], None]


@dataclass
class _Op:
    commands: list[tuple[Any, ...]] = field(default_factory=list)
    on_reply: Reply | None = None
    chunk: ChunkWrite | None = None  # chunk ops are sent as runs through CHUNKS_SCRIPT
    acks_entry: str | None = None  # jobs-stream entry this op retires
    acks_stream: str = ""  # the stream of that entry (ids repeat across a model's partitions)
    job_id: str | None = None  # the job whose chunk or status this op writes


@dataclass
class Outbox:
    """Queued writes of one worker, flushed in order."""

    keys: RedisKeys
    jobs_stream: str
    worker_name: str
    replicas: ReplicaWait | None = None  # WAIT for them before an ack goes out
    replay: ReplayLog = field(default_factory=ReplayLog)
    ops: list[_Op] = field(default_factory=list)
    _in_flight: list[_Op] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ops)

    def entries_being_acked(self) -> set[tuple[str, str]]:
        """(stream, entry id) of the entries whose XACK is queued or on its way (they still
        show as pending in Redis)."""
        ops = (*self._in_flight, *self.ops)
        return {(op.acks_stream, op.acks_entry) for op in ops if op.acks_entry}

    def jobs_queued(self) -> set[str]:
        """Jobs with a chunk or status change queued or on its way."""
        return {op.job_id for op in (*self._in_flight, *self.ops) if op.job_id}

    # ------------------------------------------------------------------ what can be queued

    def chunk(self, chunk: TokenChunk, *, set_ttl: bool = True) -> None:
        """XADD to the replay stream, then PUBLISH. `set_ttl` (re)sets the stream's TTL; once
        per attempt and on the final chunk is enough."""
        write = ChunkWrite(
            job_id=chunk.job_id,
            index=chunk.index,
            out_stream=self.keys.out_stream(chunk.job_id),
            channel=self.keys.channel(chunk.job_id),
            entry_id=chunk_stream_id(chunk.index),
            payload=chunk.to_json(),
            set_ttl=set_ttl,
        )
        self.ops.append(_Op(chunk=write, job_id=chunk.job_id))

    def transition(
        self,
        job_id: str,
        status: JobStatus,
        fields: dict[str, object],
        on_done: Callable[[bool, JobStatus | None], None] | None = None,
    ) -> None:
        """Move the job to `status` (compare-and-set); `on_done(applied, previous_or_current)`."""
        script_keys, args = transition_call(self.keys, job_id, status, fields)

        def handle(replies: list[Any]) -> None:
            reply = replies[0]
            if isinstance(reply, Exception):
                log_event(logger, logging.ERROR, "transition_error", job=job_id, error=reply)
                return
            if on_done is not None:
                on_done(*transition_applied(reply))

        script = job_channel_script(TRANSITION_SCRIPT, self.keys)
        command = ("EVAL", script, 2, *script_keys, *args)
        self.ops.append(_Op([command], handle, job_id=job_id))

    def mark_first_step(self, job_ids: list[str]) -> None:
        """Add jobs to this worker's first-step marker (see worker.crashes)."""
        key = self.keys.first_step(self.worker_name)
        self.ops.append(_Op([("SADD", key, *job_ids), ("EXPIRE", key, FIRST_STEP_TTL_S)]))

    def clear_first_step(self) -> None:
        """The step that the marker named is over."""
        self.ops.append(_Op([("DEL", self.keys.first_step(self.worker_name))]))

    def ack(self, entry_id: str, stream: str | None = None) -> None:
        """Done with a jobs-stream entry: XACK then XDEL (XLEN is the backlog). `stream`: the
        stream the entry came from when it is not the jobs stream (the bulk stream)."""
        stream = stream or self.jobs_stream
        self.ops.append(
            _Op(
                [
                    ("XACK", stream, self.keys.group, entry_id),
                    ("XDEL", stream, entry_id),
                ],
                acks_entry=entry_id,
                acks_stream=stream,
            )
        )

    def finish(
        self,
        job_id: str,
        entry_id: str,
        status: JobStatus,
        fields: dict[str, object],
        on_done: Callable[[bool, JobStatus | None], None] | None = None,
        stream: str | None = None,
    ) -> None:
        """End a job: its status (and result or error) first, then the entry's XACK + XDEL."""
        fields = {JobField.FINISHED_AT: utc_now(), **fields}
        self.transition(job_id, status, fields, on_done)
        self.ack(entry_id, stream)

    def fail(
        self,
        job_id: str | None,
        entry_id: str,
        error: ErrorBody,
        entry_fields: dict[str, str],
        attempts: int,
        stream: str | None = None,
    ) -> None:
        """A job that cannot run: dead letter (with the reason), status failed, XACK + XDEL."""
        self._dead_letter(job_id, error, entry_fields, attempts)
        if job_id is not None:
            self.finish(job_id, entry_id, JobStatus.FAILED, {JobField.ERROR: error}, stream=stream)
        else:
            self.ack(entry_id, stream)

    def _dead_letter(
        self, job_id: str | None, error: ErrorBody, entry_fields: dict[str, str], attempts: int
    ) -> None:
        model = self.keys.model_of_jobs_stream(self.jobs_stream)
        values = {
            JOB_ENTRY_FIELD: job_id or "",
            "reason": error.code.value,
            "message": error.message,
            "entry": json.dumps(entry_fields, separators=(",", ":")),
            "worker": self.worker_name,
            "at": format_time(utc_now()),
            "attempts": str(attempts),
        }
        flat = [item for pair in values.items() for item in pair]
        stream = self.keys.dead_letters(model)
        self.ops.append(_Op([("XADD", stream, "MAXLEN", "~", DEAD_LETTER_MAXLEN, "*", *flat)]))

    # ------------------------------------------------------------------ sending

    async def flush(self, redis: Redis) -> int:
        """Send everything queued in one pipeline; returns how many ops went out. On a
        connection error the ops stay queued (in order) and the error propagates."""
        if not self.ops:
            return 0
        batch, self.ops = self.ops, []
        self._in_flight = batch
        units = _units(self._with_replica_wait(batch), self.keys)
        try:
            async with redis.pipeline(transaction=False) as pipe:
                for commands, _ in units:
                    for command in commands:
                        pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
            await raise_for_cluster_outage(redis, replies)
        except BaseException:
            self.ops = batch + self.ops
            raise
        finally:
            self._in_flight = []
        for op in batch:
            if op.chunk is not None:
                self.replay.record(op.chunk)
        position = 0
        for commands, on_reply in units:
            if on_reply is not None:
                try:
                    on_reply(replies[position : position + len(commands)])
                except Exception:  # one bad callback must not lose the rest
                    logger.exception("outbox callback failed")
            position += len(commands)
        return len(batch)

    def _with_replica_wait(self, batch: list[_Op]) -> list[_Op]:
        """`batch` with a WAIT for the replicas before its first ack: a result (and every chunk
        before it) is on the replicas before its entry is retired, so a failover cannot undo
        the result yet keep the ack. Not re-queued with the batch: a re-send adds it again."""
        wait = self.replicas
        first_ack = next((i for i, op in enumerate(batch) if op.acks_entry), None)
        if wait is None or first_ack is None:
            return batch

        def check(replies: list[Any]) -> None:
            reached = replies[0]
            if fell_short(reached, wait):
                log_event(
                    logger,
                    logging.WARNING,
                    "results_not_replicated",
                    replicas=reached,
                    wanted=wait.replicas,
                    timeout_ms=wait.timeout_ms,
                )

        op = _Op([wait_command(wait)], check)
        return [*batch[:first_ack], op, *batch[first_ack:]]


def _units(batch: list[_Op], keys: RedisKeys) -> list[tuple[list[tuple[Any, ...]], Reply | None]]:
    """Commands to send, in order, each run of consecutive chunk ops folded into one EVAL."""
    units: list[tuple[list[tuple[Any, ...]], Reply | None]] = []
    run: list[ChunkWrite] = []
    for op in batch:
        if op.chunk is not None:
            run.append(op.chunk)
            continue
        if run:
            units += _chunk_run(run, keys)
            run = []
        units.append((op.commands, op.on_reply))
    if run:
        units += _chunk_run(run, keys)
    return units


def _chunk_run(run: list[ChunkWrite], keys: RedisKeys) -> list[tuple[list[tuple[Any, ...]], Reply]]:
    calls = chunk_script_calls(run, keys, OUT_STREAM_MAXLEN, OUT_STREAM_TTL_S, REPLAY_FIELD)
    return [
        ([("EVAL", script, len(script_keys), *script_keys, *args)], _check_chunk_reply)
        for script, script_keys, args in calls
    ]


def _check_chunk_reply(replies: list[Any]) -> None:
    reply = replies[0]
    if isinstance(reply, Exception):
        log_event(logger, logging.WARNING, "chunk_write_failed", error=reply)
    elif reply[1]:
        log_event(logger, logging.WARNING, "chunk_write_failed", errors=reply[1])
