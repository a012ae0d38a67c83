"""What an outbox (worker.publisher) holds and sends: an `Op` is one queued write with its
commands and reply handler; a `Plan` is one flush's commands, in units that each have their reply
handler, and what the flush learns from the replies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.cluster import ClusterNode

from schemas.chunks import ChunkWrite
from worker.chunk_relay import Command

Reply = Callable[[list[Any]], None]


@dataclass
class Op:
    commands: list[Command] = field(default_factory=list)
    on_reply: Reply | None = None
    chunk: ChunkWrite | None = None  # chunk ops are sent as worker.chunk_relay's commands
    acks_entry: str | None = None  # jobs-stream entry this op retires
    acks_stream: str = ""  # the stream of that entry (ids repeat across a model's partitions)
    job_id: str | None = None  # the job whose chunk or status this op writes
    script: str | None = None  # the script its EVALSHA runs
    ahead: bool = False  # queued to go before the engine's next step (see Outbox.ahead)


@dataclass
class Plan:
    """One flush's commands, in units that each have their reply handler."""

    units: list[tuple[list[Command], Reply | None]] = field(default_factory=list)
    # on a cluster: the node each of some units' commands goes to (unit index -> nodes)
    targets: dict[int, list[ClusterNode]] = field(default_factory=dict)
    unpublished: dict[str, list[ChunkWrite]] = field(default_factory=dict)  # job -> writes
    channels: dict[str, str] = field(default_factory=dict)  # job with chunks -> its channel
    scripts: set[str] = field(default_factory=set)  # the scripts its EVALSHAs run
    retry: list[Op] = field(default_factory=list)  # script ops Redis did not know the script of
    # on a cluster: (unit index, primary, script) of the scripts sent whole, cached there once run
    sent_whole: list[tuple[int, str, str]] = field(default_factory=list)
