"""`WAIT replicas timeout_ms` after a write that must survive a failover (an enqueued job, a
result before its ack): sent in the same pipeline as the write, so it runs on the connection
that wrote it, and judged from its reply."""

from __future__ import annotations

import logging

from schemas.redis_connection import ReplicaWait

log = logging.getLogger(__name__)


def wait_command(wait: ReplicaWait) -> tuple[str, int, int]:
    """The WAIT command, as `execute_command` arguments."""
    return ("WAIT", wait.replicas, wait.timeout_ms)


def fell_short(reply: object, wait: ReplicaWait) -> bool:
    """Whether a WAIT `reply` (the replica count, or the exception a pipeline returned in its
    place) says fewer than `wait.replicas` have the write: it stands on the master alone, and a
    failover now could lose it."""
    if isinstance(reply, Exception):
        return True
    return (reply if isinstance(reply, int) else 0) < wait.replicas


def replicated(reply: object, wait: ReplicaWait, what: str) -> bool:
    """Whether a WAIT `reply` reached `wait.replicas`; logs one line about `what` when it did
    not."""
    if isinstance(reply, Exception):
        log.warning("%s: WAIT for replicas failed: %s", what, reply)
        return False
    if fell_short(reply, wait):
        log.warning(
            "%s: only %d of %d replicas acknowledged within %d ms",
            what,
            reply if isinstance(reply, int) else 0,
            wait.replicas,
            wait.timeout_ms,
        )
        return False
    return True
