"""Interactive before bulk: a worker reads its model's jobs stream first and the
bulk stream (`RedisKeys.bulk_stream`) only with the room left, and reads the jobs stream once
more between long steps so that an interactive job that arrives while a step runs joins the
very next step."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from redis.asyncio import Redis

from schemas import RedisKeys
from worker.crashes import CrashPolicy
from worker.held import HeldJob
from worker.intake import Entry, StreamReader, Verdict

# Steps at least this long get a second, non-blocking read of the interactive stream before
# the next step (a round trip is well under a millisecond; shorter steps cost a new job less).
CATCH_UP_MIN_STEP_S = 0.02


class PriorityReader:
    """A worker's reads on both of its model's streams: the jobs stream (interactive) first,
    then the bulk stream with whatever admission room is left, so a bulk backlog never makes an
    interactive job wait for a free slot. Pending recovery, the janitor (XAUTOCLAIM) and the
    group set-up cover both streams."""

    def __init__(self, redis: Redis, keys: RedisKeys, model: str, consumer: str) -> None:
        self.interactive = StreamReader(redis, keys, keys.jobs_stream(model), consumer)
        self.bulk = StreamReader(redis, keys, keys.bulk_stream(model), consumer)
        self.stream = self.interactive.stream
        self.bulk_stream = self.bulk.stream

    @property
    def readers(self) -> tuple[StreamReader, StreamReader]:
        return self.interactive, self.bulk

    async def ensure_group(self) -> None:
        for reader in self.readers:
            await reader.ensure_group()

    async def read_own_pending(self, limit: int = 1000) -> list[Entry]:
        out: list[Entry] = []
        for reader in self.readers:
            out += await reader.read_own_pending(limit)
        return out

    async def autoclaim(self, min_idle_ms: int, count: int) -> list[Entry]:
        claimed = await self.interactive.autoclaim(min_idle_ms, count)
        if count - len(claimed) > 0:
            claimed += await self.bulk.autoclaim(min_idle_ms, count - len(claimed))
        return claimed

    async def read_new(
        self, count: int, block_ms: int | None, bulk_room: int | None = None
    ) -> list[Entry]:
        """Up to `count` new entries, interactive ones first; at most `bulk_room` bulk ones
        (None: no cap). Only the jobs stream is waited on, for `block_ms` when nothing was
        found (an idle worker; a bulk job arriving then is picked up a block later at most)."""
        entries = await self.interactive.read_new(count, None)
        room = count - len(entries)
        if bulk_room is not None:
            room = min(room, bulk_room)
        if room > 0:
            entries += await self.bulk.read_new(room, None)
        if not entries and block_ms:
            entries = await self.interactive.read_new(count, block_ms)
        return entries

    async def read_interactive(self, count: int) -> list[Entry]:
        """New interactive entries only, without waiting."""
        return await self.interactive.read_new(count, None)

    async def load(self, entries: list[Entry], policy: CrashPolicy, now: datetime) -> list[Verdict]:
        return await self.interactive.load(entries, policy, now)


class ReadPacing:
    """How much a worker reads beyond what KV admission allows: a cap on bulk jobs held at once
    (keeps sequence slots free for interactive jobs), and whether to look for interactive jobs
    once more between two steps."""

    def __init__(self, bulk_max_held: int | None, bulk_stream: str) -> None:
        self.bulk_max_held = bulk_max_held
        self.bulk_stream = bulk_stream

    def bulk_room(self, held: Iterable[HeldJob]) -> int | None:
        """How many more bulk jobs may be held (None: no cap beyond KV admission)."""
        if self.bulk_max_held is None:
            return None
        bulk = sum(1 for h in held if h.queue_stream == self.bulk_stream)
        return max(0, self.bulk_max_held - bulk)

    @staticmethod
    def catch_up_after(turn_seconds: float) -> bool:
        """Read the interactive stream again between two steps? The read made at the start
        of a step misses jobs that arrive while it runs, which would then wait a whole extra
        step; after a long step that is worth one more round trip. (A read that *waits* during
        the step would not do: Redis answers a timed-out blocked read only at its next tick,
        up to 100 ms late, and the engine would idle meanwhile.)"""
        return turn_seconds >= CATCH_UP_MIN_STEP_S
