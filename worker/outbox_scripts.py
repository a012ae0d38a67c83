"""How an outbox (worker.publisher) gets its status-change scripts run: which EVALSHAs it may send
as they are, which go with their script, and the re-send of those Redis answered NOSCRIPT.

On one Redis the scripts are loaded at the head of the pipeline whenever the outbox cannot know
Redis has them (first flush, after a failed one, on a new master). On a cluster a SCRIPT LOAD has
no key to be routed by, so a script goes whole (EVAL, which caches it there) to each primary that
the outbox has not yet seen run it (its first use there, a failover, a primary new to the slot
map), and by EVALSHA after that.

A Redis that forgot a script it had (SCRIPT FLUSH, a restart at the same address) answers that
EVALSHA with NOSCRIPT and runs nothing; the commands around it in the pipeline did run, and are
not sent again. Only the script ops go again, at once, in a second round trip that cannot meet
NOSCRIPT: the status changes are compare-and-set, and the window in which an ack that followed
one is stored before it is that round trip, as when a cluster pipeline's nodes answer apart."""

from __future__ import annotations

import logging
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, SlotNotCoveredError

from redis_io.clients import raise_for_cluster_outage
from redis_io.scripts import load_command
from schemas import RedisKeys
from worker.chunk_relay import Command
from worker.logs import log_event
from worker.outbox_ops import Op, Plan, Reply

logger = logging.getLogger(__name__)


class ScriptRouting:
    """The script side of an `Outbox` (worker.publisher), which holds the state declared here.
    The outbox's flush puts the SCRIPT LOADs at the head of its pipeline and notes the scripts
    that ran; the routing of each EVALSHA and the re-send after NOSCRIPT are here."""

    keys: RedisKeys
    ops: list[Op]
    scripts_loaded: set[str]  # scripts Redis has, as we know
    node_scripts: dict[str, set[str]]  # on a cluster: the scripts each primary has, as we know

    def forget_scripts(self) -> None:
        """Redis may not have the scripts any more (a failed flush, a new master, NOSCRIPT):
        load them again before their next EVALSHA (on a cluster: send them whole once more)."""
        self.scripts_loaded.clear()
        self.node_scripts.clear()

    async def _send_again(self, redis: Redis, ops: list[Op]) -> None:
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
        again: list[Op] = []
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

    def _cluster_script_commands(self, op: Op, plan: Plan, redis: Redis) -> list[Command]:
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
    def _node_of(op: Op, redis: Redis) -> str | None:
        """The name of the primary serving the slot of `op`'s script keys, as the cluster client
        sees the slot map now (it follows MOVED)."""
        command = op.commands[0]  # EVALSHA sha numkeys key ...
        try:
            node = cast(RedisCluster, redis).get_node_from_key(str(command[3]))
        except SlotNotCoveredError:  # no slot map yet, or a shard without a primary: go whole
            return None
        return None if node is None else str(node.name)


def _whole(op: Op, command: Command) -> Command:
    """`command`, an EVALSHA of `op`'s script, as the EVAL of its text."""
    if command[0] != "EVALSHA" or op.script is None:
        return command
    return ("EVAL", op.script, *command[2:])


def retry_on_noscript(op: Op, retry: list[Op]) -> Reply:
    """`op`'s reply handler, unless Redis did not know its script: then `op` goes to `retry`."""

    def handle(replies: list[Any]) -> None:
        if any(isinstance(reply, NoScriptError) for reply in replies):
            retry.append(op)
        elif op.on_reply is not None:
            op.on_reply(replies)

    return handle
