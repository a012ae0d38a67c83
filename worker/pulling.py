"""What a worker reads from its streams each round, and what it does with each entry read:
its own pending entries after a (re)start or a reconnect, entries the janitor claims from dead
workers, and new ones; admitted jobs join the batch, the rest are acked, expired or rejected.

A busy worker reads new entries only when its model's arrivals channel said something came (or
its last read filled the budget), and otherwise every UNPROMPTED_READ_S, for producers that
do not publish: with nothing new, a step costs no read at all."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from schemas import ErrorBody, ErrorCode, JobField, JobStatus, utc_now
from worker.batch import Batch
from worker.crashes import CrashPolicy
from worker.held import HeldJob
from worker.intake import Admit, Entry, Expire, Reject, Skip, Verdict
from worker.logs import log_event
from worker.lora_affinity import LoraAffinity
from worker.priority import PriorityReader, ReadPacing
from worker.publisher import Outbox
from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

# A busy worker with no notice of new entries still reads this often: an entry whose notice was
# lost (or that a producer added without one) waits at most this much longer.
UNPROMPTED_READ_S = 0.25


class EntryPuller:
    """Reads a worker's entries (`pull`, `take_new`) and hands each to the batch or the
    outbox."""

    def __init__(
        self,
        settings: WorkerSettings,
        reader: PriorityReader,
        batch: Batch,
        outbox: Outbox,
        stopping: Callable[[], bool],
        affinity: LoraAffinity | None = None,
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self.reader = reader
        self.pacing = ReadPacing(settings.bulk_max_held, reader.bulk_streams)
        self.crash_policy = CrashPolicy(settings.max_attempts, settings.max_crash_resumes)
        self.batch = batch
        self.outbox = outbox
        self.stopping = stopping  # a stopping worker takes on none of its pending entries
        self.affinity = affinity  # LoRA jobs offered to, and taken from, workers holding them
        self.recover_pending = True  # read our own pending entries first
        self._next_janitor = 0.0
        self._next_dead_check = 0.0
        self._arrivals = True  # new entries may be waiting (a notice, or the last read was full)
        self._next_unprompted_read = 0.0  # monotonic

    @property
    def _dead_silence_ms(self) -> int:
        """How long a worker without a heartbeat must also have left the stream alone before
        its entries are taken: half the heartbeat's TTL (a dead one's silence is already at
        least its TTL less one beat when the hash expires)."""
        return self.settings.heartbeat_ttl_s * 500

    def note_arrival(self) -> None:
        """The arrivals channel said a new entry came."""
        self._arrivals = True
        self.reader.arrived.set()

    def may_have_new(self) -> bool:
        return self._arrivals or time.monotonic() >= self._next_unprompted_read

    async def pull(self, budget: int, block: bool, read_new: bool) -> None:
        """Read up to `budget` entries (new ones only with `read_new`; waiting for them with
        `block`) and take them."""
        entries: list[Entry] = []
        if self.affinity is not None:
            await self.affinity.run_due(self.batch.queue)
            entries = self._not_held(await self.affinity.take_offers(budget))
        if self.recover_pending and not self.stopping():
            entries += self._not_held(await self.reader.read_own_pending())
            self.recover_pending = False
        if budget > len(entries) and time.monotonic() >= self._next_dead_check:
            # A dead worker's heartbeat expires well before its entries' lease: look every beat.
            self._next_dead_check = time.monotonic() + self.settings.heartbeat_interval_s
            from_dead = self._not_held(
                await self.reader.claim_from_dead(budget - len(entries), self._dead_silence_ms)
            )
            if from_dead:
                log_event(
                    logger,
                    logging.INFO,
                    "entries_claimed",
                    worker=self.name,
                    count=len(from_dead),
                    reason="dead_worker",
                )
            entries += from_dead
        if budget > 0 and time.monotonic() >= self._next_janitor:
            self._next_janitor = time.monotonic() + self.settings.janitor_every_s
            claimed = self._not_held(
                await self.reader.autoclaim(self.settings.claim_min_idle_ms, budget)
            )
            if claimed:
                log_event(
                    logger, logging.INFO, "entries_claimed", worker=self.name, count=len(claimed)
                )
            entries += claimed
        if read_new and budget - len(entries) > 0:
            wait_ms = self._read_wait_ms() if block and not entries else None
            entries += await self._read_new(budget - len(entries), wait_ms)
        elif block and not entries:
            await asyncio.sleep(self._read_wait_ms() / 1000)
        await self._load_and_take(entries)

    async def take_new(self, budget: int) -> None:
        """Read up to `budget` new entries without waiting, and take them."""
        await self._load_and_take(self._not_held(await self._read_new(budget, None)))

    async def release_offered(self) -> None:
        """Withdraw every LoRA offer and queue the jobs still this worker's (a stopping worker
        hands them back with the rest)."""
        if self.affinity is not None:
            await self.affinity.run_due(self.batch.queue, now_all=True)

    def _read_wait_ms(self) -> int:
        if self.affinity is None:
            return self.settings.block_ms
        return self.affinity.read_wait_ms(self.settings.block_ms)

    async def _load_and_take(self, entries: list[Entry]) -> None:
        if not entries:
            return
        verdicts = await self.reader.load(entries, self.crash_policy, utc_now())
        if self.affinity is not None and not self.stopping():
            verdicts = await self.affinity.defer(verdicts)
        self._take(verdicts)

    async def _read_new(self, count: int, wait_ms: int | None) -> list[Entry]:
        """Up to `count` new entries (see PriorityReader.read_new); notices that come while it
        runs count for the next read."""
        self._arrivals = False
        self._next_unprompted_read = time.monotonic() + UNPROMPTED_READ_S
        try:
            entries = await self.reader.read_new(
                count, wait_ms, self.pacing.bulk_room(self.batch.all_jobs())
            )
        except BaseException:
            self._arrivals = True
            raise
        if len(entries) >= count:
            self._arrivals = True  # more may be waiting
        return entries

    def held_jobs(self) -> list[HeldJob]:
        """The jobs whose entries this worker holds: in its batch, and offered to others."""
        offered = self.affinity.offered if self.affinity is not None else []
        return [*self.batch.all_jobs(), *offered]

    def _not_held(self, entries: list[Entry]) -> list[Entry]:
        # by stream too: two partitions of a model may hand out the same entry id
        jobs_stream = self.reader.stream
        held = {(h.queue_stream or jobs_stream, h.entry_id) for h in self.held_jobs()}
        mine = held | self.outbox.entries_being_acked()
        return [e for e in entries if (e.stream or jobs_stream, e.entry_id) not in mine]

    def _take(self, verdicts: list[Verdict]) -> None:
        for verdict in verdicts:
            if isinstance(verdict, Admit):
                self.batch.queue(verdict.held)
            elif isinstance(verdict, Skip):
                log_event(
                    logger,
                    logging.INFO,
                    "entry_skipped",
                    job=verdict.job_id,
                    entry=verdict.entry_id,
                    reason=verdict.reason,
                )
                self.outbox.ack(verdict.entry_id, verdict.stream)
            elif isinstance(verdict, Expire):
                error = ErrorBody.of(
                    ErrorCode.EXPIRED, "the deadline passed before the job started"
                )
                self.outbox.finish(
                    verdict.job_id,
                    verdict.entry_id,
                    JobStatus.EXPIRED,
                    {JobField.ERROR: error},
                    stream=verdict.stream,
                )
                self.batch.count("expired")
            elif isinstance(verdict, Reject):
                self.batch.reject(verdict)
