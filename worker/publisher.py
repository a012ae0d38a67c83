"""The outbox: Redis writes queued in order and sent as one pipelined round trip per step.

Every write here is safe to send twice (a pipeline cut off by a lost connection is re-sent
whole): chunk XADDs use explicit ids, which Redis refuses to repeat; status changes are
compare-and-set; XACK / XDEL of a gone entry are no-ops. Live listeners skip repeated PUBLISHes
by chunk index. Chunks go as plain commands, published live only where someone listens
(worker.chunk_relay); scripts go by EVALSHA. On one Redis they are loaded at the head of the
pipeline whenever this outbox cannot know Redis has them (first flush, after a failed one, on a
new master). On a cluster a SCRIPT LOAD has no key to be routed by, so a script goes whole (EVAL,
which caches it there) to each primary that this outbox has not yet seen run it (its first use
there, a failover, a primary new to the slot map), and by EVALSHA after that.

A Redis that forgot a script it had (SCRIPT FLUSH, a restart at the same address) answers that
EVALSHA with NOSCRIPT and runs nothing; the commands around it in the pipeline did run, and are
not sent again. Only the script ops go again, at once, in a second round trip that cannot meet
NOSCRIPT: the status changes are compare-and-set, and the window in which an ack that followed
one is stored before it is that round trip, as when a cluster pipeline's nodes answer apart."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import NoScriptError, SlotNotCoveredError

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
    Command,
    Listeners,
    check_chunk_replies,
    chunk_commands,
    publish_command,
)
from worker.logs import log_event
from worker.replay_log import ReplayLog

logger = logging.getLogger(__name__)

Reply = Callable[[list[Any]], None]


@dataclass
class _Op:
    commands: list[Command] = field(default_factory=list)
    on_reply: Reply | None = None
    chunk: ChunkWrite | None = None  # chunk ops are sent as worker.chunk_relay's commands
    acks_entry: str | None = None  # jobs-stream entry this op retires
    acks_stream: str = ""  # the stream of that entry (ids repeat across a model's partitions)
    job_id: str | None = None  # the job whose chunk or status this op writes
    script: str | None = None  # the script its EVALSHA runs
    ahead: bool = False  # queued to go before the engine's next step (see Outbox.ahead)


@dataclass
class _Plan:
    """One flush's commands, in units that each have their reply handler."""

    units: list[tuple[list[Command], Reply | None]] = field(default_factory=list)
    # on a cluster: the node each of some units' commands goes to (unit index -> nodes)
    targets: dict[int, list[ClusterNode]] = field(default_factory=dict)
    unpublished: dict[str, list[ChunkWrite]] = field(default_factory=dict)  # job -> writes
    channels: dict[str, str] = field(default_factory=dict)  # job with chunks -> its channel
    scripts: set[str] = field(default_factory=set)  # the scripts its EVALSHAs run
    retry: list[_Op] = field(default_factory=list)  # script ops Redis did not know the script of
    # on a cluster: (unit index, primary, script) of the scripts sent whole, cached there once run
    sent_whole: list[tuple[int, str, str]] = field(default_factory=list)


@dataclass
class Outbox:
    """Queued writes of one worker, flushed in order."""

    keys: RedisKeys
    jobs_stream: str
    worker_name: str
    replicas: ReplicaWait | None = None  # WAIT for them before an ack goes out
    replay: ReplayLog = field(default_factory=ReplayLog)
    listeners: Listeners = field(default_factory=Listeners)
    ops: list[_Op] = field(default_factory=list)
    scripts_loaded: set[str] = field(default_factory=set)  # scripts Redis has, as we know
    # on a cluster: the scripts each primary (by node name) has, as we know
    node_scripts: dict[str, set[str]] = field(default_factory=dict)
    _catch_up: list[ChunkWrite] = field(default_factory=list)  # to PUBLISH at the next flush
    _in_flight: list[_Op] = field(default_factory=list)
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

    def forget_scripts(self) -> None:
        """Redis may not have the scripts any more (a failed flush, a new master, NOSCRIPT):
        load them again before their next EVALSHA (on a cluster: send them whole once more)."""
        self.scripts_loaded.clear()
        self.node_scripts.clear()

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

    def _queue(self, op: _Op) -> None:
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
        self._queue(_Op(chunk=write, job_id=chunk.job_id))

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
        self._queue(_Op([command], handle, job_id=job_id, script=script))

    def mark_first_step(self, job_ids: list[str]) -> None:
        """Add jobs to this worker's first-step marker (see worker.crashes)."""
        key = self.keys.first_step(self.worker_name)
        self._queue(_Op([("SADD", key, *job_ids), ("EXPIRE", key, FIRST_STEP_TTL_S)]))

    def clear_first_step(self) -> None:
        """The step that the marker named is over."""
        self._queue(_Op([("DEL", self.keys.first_step(self.worker_name))]))

    def ack(self, entry_id: str, stream: str | None = None) -> None:
        """Done with a jobs-stream entry: XACK then XDEL (XLEN is the backlog). `stream`: the
        stream the entry came from when it is not the jobs stream (the bulk stream)."""
        stream = stream or self.jobs_stream
        self._queue(
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

    def announce_batch_end(self, batch_id: str, job_id: str) -> None:
        """Tell the batch's controller that this job ended (after its final status, in the same
        pipeline). Best effort: the controller still reads unannounced jobs, rarely."""
        key = self.keys.batch_ended(batch_id)
        self._queue(_Op([("RPUSH", key, job_id), ("EXPIRE", key, BATCH_ENDED_TTL_S)]))

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
        self._queue(_Op([("XADD", stream, "MAXLEN", "~", DEAD_LETTER_MAXLEN, "*", *flat)]))

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
    def _position(plan: _Plan, unit: int) -> int:
        """Where the replies of `plan`'s `unit` start."""
        return sum(len(commands) for commands, _ in plan.units[:unit])

    async def _send_again(self, redis: Redis, ops: list[_Op]) -> None:
        """Re-send script ops that met NOSCRIPT (Redis ran nothing of them), with their scripts
        (on one Redis, loaded first in the same pipeline; on a cluster, whole), in their order:
        compare-and-set, safe to send whatever came between. On a connection error they go
        first in the queue, as a failed flush's ops do, and the error propagates."""
        log_event(logger, logging.WARNING, "scripts_reloaded", ops=len(ops))
        cluster = self.keys.cluster
        nodes = [self._node_of(op, redis) if cluster else None for op in ops]
        if cluster:  # only the primaries that answered NOSCRIPT forgot
            for node in nodes:
                self.node_scripts.pop(node or "", None)
        else:
            self.scripts_loaded.clear()
        scripts = sorted({op.script for op in ops if op.script is not None})
        try:
            async with redis.pipeline(transaction=False) as pipe:
                if not cluster:
                    for script in scripts:
                        pipe.execute_command(*load_command(script))
                for op in ops:
                    for command in op.commands:
                        pipe.execute_command(*(_whole(op, command) if cluster else command))
                replies = await pipe.execute(raise_on_error=False)
            await raise_for_cluster_outage(redis, replies)
        except BaseException:
            self.ops[:0] = ops
            self.forget_scripts()
            raise
        if not cluster:
            self.scripts_loaded |= set(scripts)
        position = 0 if cluster else len(scripts)
        again: list[_Op] = []
        for op, node in zip(ops, nodes, strict=True):
            count = len(op.commands)
            reply = replies[position : position + count]
            position += count
            if any(isinstance(r, NoScriptError) for r in reply):  # flushed again in between
                again.append(op)
                continue
            if node is not None and op.script is not None and not isinstance(reply[0], Exception):
                self.node_scripts.setdefault(node, set()).add(op.script)
            if op.on_reply is not None:
                try:
                    op.on_reply(reply)
                except Exception:
                    logger.exception("outbox callback failed")
        self.ops[:0] = again

    def _plan(
        self, catch_up: list[ChunkWrite], batch: list[_Op], redis: Redis, *, look: bool = True
    ) -> _Plan:
        """The catch-up PUBLISHes, the scripts to load, every op's commands in order, and after
        them the look at who listens to the jobs written (see worker.chunk_relay)."""
        plan = _Plan()
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
                plan.units.append((commands, _retry_on_noscript(op, plan.retry)))
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

    def _cluster_script_commands(self, op: _Op, plan: _Plan, redis: Redis) -> list[Command]:
        """`op`'s EVALSHA if the primary of its keys' slot has its script (it ran it for us
        since we last had reason to doubt it, or runs it earlier in this pipeline, which keeps
        each node's commands in order); else the script whole, noted in `plan`, to be known
        there once it ran. Where a MOVED sends an EVALSHA instead, NOSCRIPT is answered and
        the op goes again whole."""
        assert op.script is not None
        node = self._node_of(op, redis)
        known = self.node_scripts.get(node or "", set())
        planned = any(n == node and s == op.script for _, n, s in plan.sent_whole)
        if node is not None and (op.script in known or planned):
            return op.commands
        if node is not None:
            plan.sent_whole.append((len(plan.units), node, op.script))
        return [_whole(op, c) for c in op.commands]

    @staticmethod
    def _node_of(op: _Op, redis: Redis) -> str | None:
        """The name of the primary serving the slot of `op`'s script keys, as the cluster client
        sees the slot map now (it follows MOVED)."""
        command = op.commands[0]  # EVALSHA sha numkeys key ...
        try:
            node = cast(RedisCluster, redis).get_node_from_key(str(command[3]))
        except SlotNotCoveredError:  # no slot map yet, or a shard without a primary: go whole
            return None
        return None if node is None else str(node.name)

    def _learn(self, plan: _Plan, replies: list[Any], *, sharded: bool = False) -> None:
        learn = self.listeners.learn_sharded if sharded else self.listeners.learn
        for job_id in learn(plan.channels, replies):
            self._catch_up += plan.unpublished.get(job_id, [])

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


def _whole(op: _Op, command: Command) -> Command:
    """`command`, an EVALSHA of `op`'s script, as the EVAL of its text."""
    if command[0] != "EVALSHA" or op.script is None:
        return command
    return ("EVAL", op.script, *command[2:])


def _retry_on_noscript(op: _Op, retry: list[_Op]) -> Reply:
    """`op`'s reply handler, unless Redis did not know its script: then `op` goes to `retry`."""

    def handle(replies: list[Any]) -> None:
        if any(isinstance(reply, NoScriptError) for reply in replies):
            retry.append(op)
        elif op.on_reply is not None:
            op.on_reply(replies)

    return handle
