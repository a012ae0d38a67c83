"""Interactive before bulk: a worker reads its model's jobs stream first and the
bulk stream (`RedisKeys.bulk_stream`) only with the room left, and after a long step reads
before the next one starts, so that a job that arrives while a step runs joins the very next
step."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from datetime import datetime

from redis.asyncio import Redis

from redis_io.scripts import run_script
from schemas import RedisKeys
from schemas.redis_scripts import READ_NEW_JOBS_SCRIPT
from worker.crashes import CrashPolicy
from worker.held import HeldJob
from worker.intake import Entry, StreamReader, Verdict, script_entries
from worker.janitor import dead_consumers
from worker.shard_homes import ShardHomes

# After steps at least this long, new entries are read between steps rather than beside them (a
# round trip is well under a millisecond; shorter steps cost a new job less).
READ_BETWEEN_MIN_STEP_S = 0.02


class PriorityReader:
    """A worker's reads on its model's streams: the jobs stream (interactive) first, then the
    bulk stream with whatever admission room is left, so a bulk backlog never makes an
    interactive job wait for a free slot. Pending recovery, the janitor (XAUTOCLAIM) and the
    group set-up cover both streams.

    With partitions (`RedisKeys.partitions`), the model's queue is several pairs of streams
    (partition k of the jobs stream and of the bulk stream share a hash slot, so one script
    reads both): every read goes over all pairs within the one budget, starting at the next
    pair each time so no partition waits behind the others."""

    def __init__(self, redis: Redis, keys: RedisKeys, model: str, consumer: str) -> None:
        self.pairs = [
            (
                StreamReader(redis, keys, keys.jobs_stream(model, k), consumer),
                StreamReader(redis, keys, keys.bulk_stream(model, k), consumer),
            )
            for k in range(keys.partitions)
        ]
        self.interactive, self.bulk = self.pairs[0]
        self.stream = self.interactive.stream
        self.bulk_stream = self.bulk.stream
        self.bulk_streams = frozenset(bulk.stream for _, bulk in self.pairs)
        self.keys = keys
        self.consumer = consumer
        self.redis = redis
        self._next_pair = 0
        # set by the arrivals channel: an idle worker with several partitions waits on it
        # instead of a blocked read (which could watch one partition only)
        self.arrived = asyncio.Event()
        self.homes: ShardHomes | None = None  # on a cluster: the partitions read first

    @property
    def readers(self) -> tuple[StreamReader, ...]:
        return tuple(reader for pair in self.pairs for reader in pair)

    async def ensure_group(self) -> None:
        for reader in self.readers:
            await reader.ensure_group()

    async def read_own_pending(self, limit: int = 1000) -> list[Entry]:
        out: list[Entry] = []
        for reader in self.readers:
            out += await reader.read_own_pending(limit)
        return out

    async def autoclaim(self, min_idle_ms: int, count: int) -> list[Entry]:
        claimed: list[Entry] = []
        for reader in (*(i for i, _ in self.pairs), *(b for _, b in self.pairs)):
            if count - len(claimed) <= 0:
                break
            claimed += await reader.autoclaim(min_idle_ms, count - len(claimed))
        return claimed

    async def claim_from_dead(self, count: int, min_silence_ms: int) -> list[Entry]:
        """Take over up to `count` pending entries of workers known dead (see
        `worker.janitor.dead_consumers`) at once, without waiting out their lease."""
        claimed: list[Entry] = []
        for reader in self.readers:
            dead = await dead_consumers(
                self.redis, self.keys, reader.stream, self.consumer, min_silence_ms
            )
            for consumer in dead:
                if count - len(claimed) <= 0:
                    return claimed
                claimed += await reader.claim_from(consumer, count - len(claimed), min_silence_ms)
        return claimed

    async def read_new(
        self, count: int, block_ms: int | None, bulk_room: int | None = None
    ) -> list[Entry]:
        """Up to `count` new entries, interactive ones first; at most `bulk_room` bulk ones
        (None: no cap), one round trip per partition. With one partition only its jobs stream
        is waited on, for `block_ms` when nothing was found (an idle worker; a bulk job arriving
        then is picked up a block later at most); with several, the wait is for an arrivals
        notice (or `block_ms`), then every partition is read again."""
        if count <= 0:
            return []
        self.arrived.clear()
        entries = await self._read_pairs(count, bulk_room)
        if entries or not block_ms:
            return entries
        if len(self.pairs) == 1:
            return await self.interactive.read_new(count, block_ms)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.arrived.wait(), block_ms / 1000)
        return await self._read_pairs(count, bulk_room)

    def _pair_order(self) -> list[int]:
        """The pairs in the order one read takes them: from the next pair on, each read
        starting one further; on a cluster the pairs on this worker's home shards first
        (worker.shard_homes)."""
        start = self._next_pair
        self._next_pair = (start + 1) % len(self.pairs)
        order = [(start + k) % len(self.pairs) for k in range(len(self.pairs))]
        if self.homes is None:
            return order
        home = self.homes.home([interactive.stream for interactive, _ in self.pairs])
        return [k for k in order if k in home] + [k for k in order if k not in home]

    async def _read_pairs(self, count: int, bulk_room: int | None) -> list[Entry]:
        entries: list[Entry] = []
        for k in self._pair_order():
            left = count - len(entries)
            if left <= 0:
                break
            interactive, bulk = self.pairs[k]
            bulk_taken = sum(1 for e in entries if e.stream in self.bulk_streams)
            most_bulk = left if bulk_room is None else max(0, min(left, bulk_room - bulk_taken))
            reply = await run_script(
                self.redis,
                READ_NEW_JOBS_SCRIPT,
                [interactive.stream, bulk.stream],
                [self.keys.group, self.consumer, left, most_bulk],
            )
            entries += script_entries(reply, (interactive.stream, bulk.stream))
        return entries

    async def load(self, entries: list[Entry], policy: CrashPolicy, now: datetime) -> list[Verdict]:
        return await self.interactive.load(entries, policy, now)


class ReadPacing:
    """How much a worker reads beyond what KV admission allows: a cap on bulk jobs held at once
    (keeps sequence slots free for interactive jobs), and whether to read between two steps or
    beside the next."""

    def __init__(self, bulk_max_held: int | None, bulk_streams: Iterable[str]) -> None:
        self.bulk_max_held = bulk_max_held
        self.bulk_streams = frozenset(bulk_streams)

    def bulk_room(self, held: Iterable[HeldJob]) -> int | None:
        """How many more bulk jobs may be held (None: no cap beyond KV admission)."""
        if self.bulk_max_held is None:
            return None
        bulk = sum(1 for h in held if h.queue_stream in self.bulk_streams)
        return max(0, self.bulk_max_held - bulk)

    @staticmethod
    def read_between_steps(turn_seconds: float) -> bool:
        """Read new entries between this step and the next, rather than beside the next?
        A read made beside a step misses jobs that arrive while it runs, which would then
        wait a whole extra step; after a long step, reading with the engine idle lets them
        join the very next one, and costs it one round trip. (A read that *waits* during the
        step would not do: Redis answers a timed-out blocked read only at its next tick, up to
        100 ms late, and the engine would idle meanwhile.)"""
        return turn_seconds >= READ_BETWEEN_MIN_STEP_S
