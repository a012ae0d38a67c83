"""Interactive before bulk (issue 7): a worker reads its model's jobs stream first and the
bulk stream (`RedisKeys.bulk_stream`) only with the room left, and paces its reads so that an
interactive job that arrives while a step runs joins the very next step."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from redis.asyncio import Redis

from schemas import RedisKeys
from worker.held import HeldJob
from worker.intake import Entry, StreamReader, Verdict

_STEP_EMA_WEIGHT = 0.2
_BUSY_WAIT_SHARE = 0.8  # of a step: the read returns before the step ends, not after


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
        self,
        count: int,
        block_ms: int | None,
        bulk_room: int | None = None,
        busy_wait_ms: int | None = None,
    ) -> list[Entry]:
        """Up to `count` new entries, interactive ones first; at most `bulk_room` bulk ones
        (None: no cap). Only the jobs stream is waited on: `block_ms` when nothing was found
        (an idle worker; a bulk job arriving then is picked up a block later at most), and
        `busy_wait_ms` while a step runs, so an interactive job arriving mid-step joins the
        next step."""
        entries = await self.interactive.read_new(count, None)
        room = count - len(entries)
        if bulk_room is not None:
            room = min(room, bulk_room)
        if room > 0:
            entries += await self.bulk.read_new(room, None)
        if not entries and block_ms:
            entries = await self.interactive.read_new(count, block_ms)
        elif busy_wait_ms and count - len(entries) > 0:
            entries += await self.interactive.read_new(count - len(entries), busy_wait_ms)
        return entries

    async def load(self, entries: list[Entry], max_attempts: int, now: datetime) -> list[Verdict]:
        return await self.interactive.load(entries, max_attempts, now)


class ReadPacing:
    """How much a worker reads beyond what KV admission allows: a cap on bulk jobs held at once
    (keeps sequence slots free for interactive jobs), and how long a read made while a step
    runs may wait on the interactive stream."""

    def __init__(self, bulk_max_held: int | None, bulk_stream: str) -> None:
        self.bulk_max_held = bulk_max_held
        self.bulk_stream = bulk_stream
        self.step_ema_s = 0.0  # recent engine step time

    def observe_step(self, seconds: float) -> None:
        self.step_ema_s += _STEP_EMA_WEIGHT * (seconds - self.step_ema_s)

    def bulk_room(self, held: Iterable[HeldJob]) -> int | None:
        """How many more bulk jobs may be held (None: no cap beyond KV admission)."""
        if self.bulk_max_held is None:
            return None
        bulk = sum(1 for h in held if h.queue_stream == self.bulk_stream)
        return max(0, self.bulk_max_held - bulk)

    def busy_wait_ms(self, block: bool) -> int | None:
        """While a step runs, wait on the interactive stream for most of the step's expected
        length: a job arriving mid-step is then read in time to join the next step instead of
        the one after (a step of TTFT saved under load)."""
        if block:
            return None
        wait_ms = int(self.step_ema_s * 1000 * _BUSY_WAIT_SHARE)
        return wait_ms if wait_ms >= 2 else None
