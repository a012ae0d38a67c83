"""How chunks go to Redis: plain pipelined commands (XADD, then PUBLISH, then EXPIRE), and the
live PUBLISH only for jobs whose channel has a subscriber.

Each command is safe alone and safe twice (the XADD's explicit id refuses a repeat; readers
skip a repeated PUBLISH by chunk index), so no script is needed to run them together.

Who listens is learnt from Redis itself (`PUBSUB NUMSUB` of the channels just written, plus
`PUBSUB NUMPAT`, as any pattern subscriber may be one), asked in the same pipeline AFTER the
chunks' XADDs. Readers subscribe first and replay the stream after (see schemas.chunks), and
that order makes skipping safe: a reader that subscribed before the look is counted by it, and
the chunks of that pipeline it may have missed are published in the next one (a catch-up);
a reader that subscribed after the look replays after it, so it finds every chunk XADDed
before the look in the replay stream. A job nobody has looked at yet publishes (its first
chunk goes out live without waiting for an answer). On a Redis Cluster the channel is sharded
(SPUBLISH, SSUBSCRIBE on the job's own shard) and the look is `PUBSUB SHARDNUMSUB`, sent to
each channel's shard: the node that holds the job's replay stream too, so there the look also
follows the XADDs; sharded channels have no pattern subscribers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import OUT_STREAM_MAXLEN, OUT_STREAM_TTL_S
from schemas.chunks import REPLAY_FIELD, ChunkWrite
from worker.logs import log_event

logger = logging.getLogger(__name__)

Command = tuple[Any, ...]
REFUSED_REPEAT = "equal or smaller"  # XADD's error for an id it already has (or passed)


def chunk_commands(
    write: ChunkWrite,
    *,
    publish: bool,
    maxlen: int = OUT_STREAM_MAXLEN,
    ttl_s: int = OUT_STREAM_TTL_S,
    field_name: str = REPLAY_FIELD,
    sharded: bool = False,
) -> list[Command]:
    """XADD to the replay stream, then PUBLISH (when `publish`; SPUBLISH when `sharded`, as on
    a cluster), then EXPIRE (when asked).
    The XADD names its MAXLEN only from chunk `maxlen` on: before, the stream (at most one
    entry per chunk so far) is below the cap, and the three arguments cost on every chunk."""
    trim = ("MAXLEN", "~", maxlen) if write.index + 1 > maxlen else ()
    payload = write.payload.encode()  # once, for both commands
    commands: list[Command] = [
        ("XADD", write.out_stream, *trim, write.entry_id, field_name, payload)
    ]
    if publish:
        commands.append((_publish_verb(sharded), write.channel, payload))
    if write.set_ttl:
        commands.append(("EXPIRE", write.out_stream, ttl_s))
    return commands


def publish_command(write: ChunkWrite, *, sharded: bool = False) -> Command:
    """The live copy of a chunk, on the job's channel."""
    return (_publish_verb(sharded), write.channel, write.payload)


def _publish_verb(sharded: bool) -> str:
    return "SPUBLISH" if sharded else "PUBLISH"


def check_chunk_replies(replies: Sequence[Any]) -> None:
    """Log a failed chunk write (a refused repeat is no failure: the chunk is there)."""
    errors = [r for r in replies if isinstance(r, Exception) and REFUSED_REPEAT not in str(r)]
    if errors:
        log_event(logger, logging.WARNING, "chunk_write_failed", errors=errors)


@dataclass
class Listeners:
    """Which jobs had a subscriber on their channel at the last look. `look_interval_s`: how
    long a worker with nothing to write waits between looks for a new subscriber (a flush that
    writes chunks looks anyway): every look is a round trip to each Redis holding unheard
    jobs, and an engine stepping every millisecond would otherwise make one a step."""

    look_interval_s: float = 0.0
    _last_look: float = float("-inf")
    _heard: dict[str, bool] = field(default_factory=dict)
    _channels: dict[str, str] = field(default_factory=dict)  # job -> channel, of jobs looked at

    def publishes(self, job_id: str) -> bool:
        """Whether a chunk of `job_id` goes out live now (yes until a look said nobody)."""
        return self._heard.get(job_id, True)

    def keep_only(self, job_ids: Iterable[str]) -> None:
        keep = set(job_ids)
        for job_id in [j for j in self._heard if j not in keep]:
            del self._heard[job_id]
            self._channels.pop(job_id, None)

    def look_due(self) -> bool:
        """Whether a flush should go out only to look at unheard jobs now."""
        due = time.monotonic() - self._last_look >= self.look_interval_s
        return due and any(not heard for heard in self._heard.values())

    def unheard(self) -> dict[str, str]:
        """Jobs (and their channels) nobody listened to at the last look: each flush looks
        again, chunks or not, so a listener that subscribes is noticed within a round."""
        return {
            job_id: self._channels[job_id] for job_id, heard in self._heard.items() if not heard
        }

    @staticmethod
    def look_commands(channels: Sequence[str]) -> list[Command]:
        """The look, sent after the XADDs of the chunks it is for."""
        return [("PUBSUB NUMSUB", *channels), ("PUBSUB NUMPAT",)]

    @staticmethod
    def shard_look_command(channels: Sequence[str]) -> Command:
        """The look on a cluster, one per shard (for the channels that shard holds)."""
        return ("PUBSUB SHARDNUMSUB", *channels)

    def learn(self, job_channels: dict[str, str], replies: Sequence[Any]) -> set[str]:
        """Take the look's replies for `job_channels` (job id -> channel); returns the jobs
        heard now (what they were sent unpublished needs a catch-up). A failed look counts as
        everyone listening."""
        numsub, numpat = replies
        if isinstance(numsub, Exception) or isinstance(numpat, Exception):
            error = numsub if isinstance(numsub, Exception) else numpat
            log_event(logger, logging.WARNING, "listener_look_failed", error=error)
            return self._take(job_channels, {}, anyone=True)
        return self._take(job_channels, _counts(numsub), anyone=int(numpat) > 0)

    def learn_sharded(self, job_channels: dict[str, str], replies: Sequence[Any]) -> set[str]:
        """`learn` from the shards' SHARDNUMSUB replies (one per shard looked at)."""
        errors = [reply for reply in replies if isinstance(reply, Exception)]
        if errors:
            log_event(logger, logging.WARNING, "listener_look_failed", error=errors[0])
            return self._take(job_channels, {}, anyone=True)
        counts: dict[str, int] = {}
        for reply in replies:
            counts.update(_counts(reply))
        return self._take(job_channels, counts, anyone=False)

    def _take(self, job_channels: dict[str, str], counts: dict[str, int], anyone: bool) -> set[str]:
        self._last_look = time.monotonic()
        heard = set()
        for job_id, channel in job_channels.items():
            self._channels[job_id] = channel
            self._heard[job_id] = anyone or counts.get(channel, 0) > 0
            if self._heard[job_id]:
                heard.add(job_id)
        return heard


def _counts(numsub: Sequence[Any]) -> dict[str, int]:
    """Channel -> subscribers from a NUMSUB reply: pairs, or the flat list a pipeline without
    the client's reply parsing gives."""
    if numsub and not isinstance(numsub[0], list | tuple):
        numsub = list(zip(numsub[::2], numsub[1::2], strict=True))
    return {_text(channel): int(count) for channel, count in numsub}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
