"""The outbox: Redis writes queued in order and sent as one pipelined round trip per step.

Every write here is safe to send twice (a pipeline cut off by a lost connection is re-sent
whole): chunk XADDs use explicit ids, which Redis refuses to repeat; status changes are
compare-and-set; XACK / XDEL of a gone entry are no-ops. Live listeners skip repeated PUBLISHes
by chunk index. Chunks go as plain commands, published live only where someone listens
(worker.chunk_relay); status changes go as scripts by EVALSHA, loaded, sent whole and re-sent
after NOSCRIPT as worker.outbox_scripts says. The ops queued and a flush's plan are
worker.outbox_ops' types."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from redis_io.clients import channels_by_shard, raise_for_cluster_outage
from redis_io.replica_wait import fell_short, wait_command
from redis_io.scripts import evalsha_command, load_command
from schemas import (
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
from schemas.batches import BATCH_ENDED_TTL_S
from schemas.chunks import ChunkWrite
from schemas.keys import DEAD_LETTER_MAXLEN, FIRST_STEP_TTL_S, JOB_ENTRY_FIELD
from schemas.redis_connection import ReplicaWait
from schemas.redis_scripts import job_channel_script
from worker.chunk_relay import (
    Listeners,
    check_chunk_replies,
    chunk_commands,
    publish_command,
)
from worker.logs import log_event
from worker.outbox_ops import Op, Plan
from worker.outbox_scripts import ScriptRouting, retry_on_noscript
from worker.replay_log import ReplayLog

logger = logging.getLogger(__name__)


@dataclass
class Outbox(ScriptRouting):
    """Queued writes of one worker, flushed in order."""

    keys: RedisKeys
    jobs_stream: str
    worker_name: str
    replicas: ReplicaWait | None = None  # WAIT for them before an ack goes out
    replay: ReplayLog = field(default_factory=ReplayLog)
    listeners: Listeners = field(default_factory=Listeners)
    ops: list[Op] = field(default_factory=list)
    scripts_loaded: set[str] = field(default_factory=set)  # scripts Redis has, as we know
    # on a cluster: the scripts each primary (by node name) has, as we know
    node_scripts: dict[str, set[str]] = field(default_factory=dict)
    _catch_up: list[ChunkWrite] = field(default_factory=list)  # to PUBLISH at the next flush
    _in_flight: list[Op] = field(default_factory=list)
    _ahead: bool = False  # ops queued now are marked `ahead`

    def __len__(self) -> int:
        return len(self.ops)

    def entries_being_acked(self) -> set[tuple[str, str]]:
        """(stream, entry id) of the entries whose XACK is queued or on its way (they still
        show as pending in Redis)."""
        ops = (*self._in_flight, *self.ops)
        return {(op.acks_stream, op.acks_entry) for op in ops if op.acks_entry}

    @property
    def pending(self) -> bool:
        """Whether a flush has anything to send (a look at unheard jobs, once due, counts)."""
        return bool(self.ops or self._catch_up or self.listeners.look_due())

    def keep_only(self, job_ids: set[str]) -> None:
        """Forget what is kept per job for the jobs not in `job_ids` (no longer this worker's)."""
        self.replay.keep_only(job_ids)
        self.listeners.keep_only(job_ids)

    def jobs_queued(self) -> set[str]:
        """Jobs with a chunk or status change queued or on its way."""
        return {op.job_id for op in (*self._in_flight, *self.ops) if op.job_id}

    @contextmanager
    def ahead(self) -> Iterator[None]:
        """Ops queued inside go out with `flush(ahead_only=True)`, before the ones queued
        earlier outside: what must be stored before the engine's next step (starts, the
        first-step marker) need not wait for the last step's results to be written first."""
        self._ahead = True
        try:
            yield
        finally:
            self._ahead = False

    def _queue(self, op: Op) -> None:
        op.ahead = self._ahead
        self.ops.append(op)

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
        self._queue(Op(chunk=write, job_id=chunk.job_id))

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
        command = evalsha_command(script, script_keys, args)
        self._queue(Op([command], handle, job_id=job_id, script=script))

    def mark_first_step(self, job_ids: list[str]) -> None:
        """Add jobs to this worker's first-step marker (see worker.crashes)."""
        key = self.keys.first_step(self.worker_name)
        self._queue(Op([("SADD", key, *job_ids), ("EXPIRE", key, FIRST_STEP_TTL_S)]))

    def clear_first_step(self) -> None:
        """The step that the marker named is over."""
        self._queue(Op([("DEL", self.keys.first_step(self.worker_name))]))

    def ack(self, entry_id: str, stream: str | None = None) -> None:
        """Done with a jobs-stream entry: XACK then XDEL (XLEN is the backlog). `stream`: the
        stream the entry came from when it is not the jobs stream (the bulk stream)."""
        stream = stream or self.jobs_stream
        self._queue(
            Op(
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

    def announce_batch_end(self, batch_id: str, job_id: str) -> None:
        """Tell the batch's controller that this job ended (after its final status, in the same
        pipeline). Best effort: the controller still reads unannounced jobs, rarely."""
        key = self.keys.batch_ended(batch_id)
        self._queue(Op([("RPUSH", key, job_id), ("EXPIRE", key, BATCH_ENDED_TTL_S)]))

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
        self._queue(Op([("XADD", stream, "MAXLEN", "~", DEAD_LETTER_MAXLEN, "*", *flat)]))

    # ------------------------------------------------------------------ sending

    async def flush(self, redis: Redis, *, ahead_only: bool = False) -> int:
        """Send everything queued (`ahead_only`: the ops queued `ahead`) in one pipeline;
        returns how many ops went out. On a connection error the ops stay queued (in order,
        those sent ahead first) and the error propagates."""
        if ahead_only:
            batch = [op for op in self.ops if op.ahead]
            if not batch:
                return 0
            self.ops = [op for op in self.ops if not op.ahead]
            catch_up: list[ChunkWrite] = []
        elif not self.pending:
            return 0
        else:
            batch, self.ops = self.ops, []
            catch_up, self._catch_up = self._catch_up, []
        self._in_flight = batch
        plan = self._plan(catch_up, self._with_replica_wait(batch), redis, look=not ahead_only)
        try:
            async with redis.pipeline(transaction=False) as pipe:
                for unit, (commands, _) in enumerate(plan.units):
                    nodes = plan.targets.get(unit)
                    for i, command in enumerate(commands):
                        if nodes is None:
                            pipe.execute_command(*command)
                        else:
                            pipe.execute_command(*command, target_nodes=nodes[i])
                replies = await pipe.execute(raise_on_error=False)
            await raise_for_cluster_outage(redis, replies)
        except BaseException:
            self.ops = batch + self.ops
            self._catch_up = catch_up + self._catch_up
            self.forget_scripts()
            raise
        finally:
            self._in_flight = []
        if self.keys.cluster:
            for unit, node, script in plan.sent_whole:
                if not isinstance(replies[self._position(plan, unit)], Exception):
                    self.node_scripts.setdefault(node, set()).add(script)
        else:
            self.scripts_loaded |= plan.scripts
        for op in batch:
            if op.chunk is not None:
                self.replay.record(op.chunk)
        position = 0
        for commands, on_reply in plan.units:
            if on_reply is not None:
                try:
                    on_reply(replies[position : position + len(commands)])
                except Exception:  # one bad callback must not lose the rest
                    logger.exception("outbox callback failed")
            position += len(commands)
        if plan.retry:
            await self._send_again(redis, plan.retry)
        return len(batch)

    @staticmethod
    def _position(plan: Plan, unit: int) -> int:
        """Where the replies of `plan`'s `unit` start."""
        return sum(len(commands) for commands, _ in plan.units[:unit])

    def _plan(
        self, catch_up: list[ChunkWrite], batch: list[Op], redis: Redis, *, look: bool = True
    ) -> Plan:
        """The catch-up PUBLISHes, the scripts to load, every op's commands in order, and after
        them the look at who listens to the jobs written (see worker.chunk_relay)."""
        plan = Plan()
        if catch_up:
            publishes = [publish_command(write, sharded=self.keys.cluster) for write in catch_up]
            plan.units.append((publishes, None))
        plan.scripts = {op.script for op in batch if op.script is not None}
        if plan.scripts - self.scripts_loaded and not self.keys.cluster:
            loads = [load_command(s) for s in sorted(plan.scripts - self.scripts_loaded)]
            plan.units.append((loads, None))
        for op in batch:
            if op.chunk is not None:
                write = op.chunk
                publish = self.listeners.publishes(write.job_id)
                if not publish:
                    plan.unpublished.setdefault(write.job_id, []).append(write)
                plan.channels[write.job_id] = write.channel
                commands = chunk_commands(write, publish=publish, sharded=self.keys.cluster)
                plan.units.append((commands, check_chunk_replies))
            elif op.script is not None:
                commands = op.commands
                if self.keys.cluster:
                    commands = self._cluster_script_commands(op, plan, redis)
                plan.units.append((commands, retry_on_noscript(op, plan.retry)))
            else:
                plan.units.append((op.commands, op.on_reply))
        if look:
            plan.channels = {**self.listeners.unheard(), **plan.channels}
        if plan.channels and self.keys.cluster:
            by_shard = channels_by_shard(redis, plan.channels.values())
            looks = [Listeners.shard_look_command(channels) for _, channels in by_shard]
            plan.targets[len(plan.units)] = [node for node, _ in by_shard]
            plan.units.append((looks, lambda replies: self._learn(plan, replies, sharded=True)))
        elif plan.channels:
            looks = Listeners.look_commands(list(plan.channels.values()))
            plan.units.append((looks, lambda replies: self._learn(plan, replies)))
        return plan

    def _learn(self, plan: Plan, replies: list[Any], *, sharded: bool = False) -> None:
        learn = self.listeners.learn_sharded if sharded else self.listeners.learn
        for job_id in learn(plan.channels, replies):
            self._catch_up += plan.unpublished.get(job_id, [])

    def _with_replica_wait(self, batch: list[Op]) -> list[Op]:
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

        op = Op([wait_command(wait)], check)
        return [*batch[:first_ack], op, *batch[first_ack:]]
