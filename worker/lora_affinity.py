"""LoRA affinity: a job for an adapter goes to a worker that already holds it, when one has room.

Any live worker of the base model takes a job for one of its adapters (loading it on demand),
but a worker that holds the adapter resident (in its engine's slots) runs it without loading
anything. The rule, within the queue's delivery guarantees:

- A worker that reads a fresh job (never started) for an adapter it does not hold resident,
  while the heartbeat of another live worker of the model (read at most `PEERS_MAX_AGE_S` ago)
  shows that adapter resident and room (nothing waiting, KV blocks free), does not run it at
  once: it keeps the entry pending under its own name (lease renewed, as for any held job) and
  offers it in the partition's offers set (`schemas.keys.RedisKeys.lora_offers`) for
  `lora_affinity_wait_s`.
- A worker with room and adapters resident takes, every read, the live offers for those
  adapters: one script claims the entry (XCLAIM) into its own name and drops the offer, only if
  the entry is still pending under the worker that offered it.
- When the wait ends the offering worker withdraws the offer (one script) and runs the job
  itself, unless the entry changed hands. So no job waits for a worker longer than the wait
  (plus one read), and each entry has one owner at any time: an offer taken is the taker's, an
  offer withdrawn the offerer's.

Nothing is lost when a worker dies: an offered entry is pending under its offerer, whose death
hands it to the janitor as any held job (and an offer of an entry claimed over from the dead is
never taken, as its owner changed); a taken entry is pending under its taker. A worker that
stops withdraws its offers and hands the jobs back with its others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from redis_io.scripts import run_script
from schemas import JobStatus, RedisKeys, WorkerInfo
from schemas.jobs import as_text
from schemas.keys import encode_segment
from schemas.redis_scripts import LORA_OFFER_SCRIPT, LORA_TAKE_SCRIPT, LORA_WITHDRAW_SCRIPT
from worker.held import HeldJob
from worker.intake import Admit, Entry, Verdict, script_entries
from worker.logs import log_event

logger = logging.getLogger(__name__)

PEERS_MAX_AGE_S = 1.0  # how stale the view of other workers' adapters may be
OFFER_POLL_MS = 100  # a worker holding adapters looks for offers this often
STALE_OFFER_MS = 60_000  # offers past their deadline this long are dropped by any taker


@dataclass
class Offer:
    """A job this worker read and offered to a worker that holds its adapter."""

    held: HeldJob
    member: str
    offers_key: str
    stream: str
    ends_at: float  # monotonic


@dataclass(frozen=True)
class _Partition:
    offers: str
    jobs: str
    bulk: str


class LoraAffinity:
    """One worker's side of LoRA affinity (see the module docstring): `defer` the jobs to offer,
    `take_offers` of others, `run_due` its offers whose wait ended (all of them on stop)."""

    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        model: str,
        consumer: str,
        wait_s: float,
        resident: Callable[[], list[str]],
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self.wait_s = wait_s
        self.resident = resident  # the adapters in this worker's engine slots now, by name
        self._partitions = [
            _Partition(
                keys.lora_offers(model, k), keys.jobs_stream(model, k), keys.bulk_stream(model, k)
            )
            for k in range(keys.partitions)
        ]
        self._by_stream = {
            stream: (p, kind)
            for p in self._partitions
            for stream, kind in ((p.jobs, "j"), (p.bulk, "b"))
        }
        self._offers: dict[tuple[str, str], Offer] = {}  # (stream, entry id) -> offer
        # entries taken from offers, not yet loaded: they run here, never offered on (which
        # would stretch their wait beyond one offer's)
        self._taken: set[tuple[str, str]] = set()
        self._peers: list[WorkerInfo] = []
        self._peers_read_at = float("-inf")
        self._next_take = 0.0  # monotonic: when to look for offers again

    @property
    def offered(self) -> list[HeldJob]:
        """The jobs offered and not yet run (their entries stay pending under this worker)."""
        return [offer.held for offer in self._offers.values()]

    def read_wait_ms(self, block_ms: int) -> int:
        """How long an idle read may block: short enough to see offers for the adapters held
        here, and to run its own offers when their wait ends."""
        wait = block_ms
        if self.resident():
            wait = min(wait, OFFER_POLL_MS)
        if self._offers:
            first = min(offer.ends_at for offer in self._offers.values())
            wait = min(wait, max(1, int((first - time.monotonic()) * 1000) + 1))
        return wait

    async def defer(self, verdicts: list[Verdict]) -> list[Verdict]:
        """Offer the admitted fresh jobs whose adapter a peer holds resident with room; the
        verdicts to act on now."""
        if self.wait_s <= 0:
            return verdicts
        resident = set(self.resident())
        taken, self._taken = self._taken, set()
        candidates = [
            v
            for v in verdicts
            if isinstance(v, Admit)
            and (v.held.queue_stream, v.held.entry_id) not in taken
            and v.held.job.request.lora is not None
            and v.held.job.request.lora not in resident
            and v.held.job.status is JobStatus.QUEUED
            and not v.held.job.attempts
        ]
        if not candidates:
            return verdicts
        held_elsewhere = await self._held_by_peers()
        offered: set[int] = set()
        for verdict in candidates:
            if verdict.held.job.request.lora in held_elsewhere:
                await self._offer(verdict.held)
                offered.add(id(verdict))
        return [v for v in verdicts if id(v) not in offered]

    async def take_offers(self, budget: int) -> list[Entry]:
        """Claim up to `budget` live offers for the adapters resident here."""
        adapters = [encode_segment(name) for name in self.resident()]
        now = time.monotonic()
        if budget <= 0 or not adapters or now < self._next_take:
            return []
        # at most every OFFER_POLL_MS: a busy worker pulls every step, and a step's Redis work
        # stays one round trip but for this
        self._next_take = now + OFFER_POLL_MS / 1000
        taken: list[Entry] = []
        for p in self._partitions:
            left = budget - len(taken)
            if left <= 0:
                break
            reply = await run_script(
                self.redis,
                LORA_TAKE_SCRIPT,
                [p.offers, p.jobs, p.bulk],
                [self.keys.group, self.consumer, left, STALE_OFFER_MS, *adapters],
            )
            taken += script_entries(reply, (p.jobs, p.bulk))
        self._taken.update((entry.stream, entry.entry_id) for entry in taken)
        if taken:
            log_event(
                logger, logging.INFO, "lora_offers_taken", worker=self.consumer, count=len(taken)
            )
        return taken

    async def run_due(self, run: Callable[[HeldJob], None], now_all: bool = False) -> None:
        """Withdraw the offers whose wait ended (all of them with `now_all`) and `run` each job
        still this worker's, as soon as its offer is withdrawn. Those another worker took are
        forgotten here."""
        now = time.monotonic()
        ended = [key for key, offer in self._offers.items() if now_all or offer.ends_at <= now]
        for key in ended:
            offer = self._offers[key]
            still_mine = await run_script(
                self.redis,
                LORA_WITHDRAW_SCRIPT,
                [offer.offers_key, offer.stream],
                [offer.member, self.keys.group, offer.held.entry_id, self.consumer],
            )
            del self._offers[key]
            if int(still_mine):
                run(offer.held)
            else:
                log_event(
                    logger,
                    logging.INFO,
                    "lora_offer_taken",
                    job=offer.held.job_id,
                    adapter=offer.held.job.request.lora,
                )

    async def _offer(self, held: HeldJob) -> None:
        stream = held.queue_stream or self._partitions[0].jobs
        partition, kind = self._by_stream[stream]
        adapter = held.job.request.lora or ""
        member = f"{kind}|{held.entry_id}|{encode_segment(adapter)}|{self.consumer}"
        wait_ms = max(1, round(self.wait_s * 1000))
        await run_script(
            self.redis,
            LORA_OFFER_SCRIPT,
            [partition.offers],
            [member, wait_ms, wait_ms + STALE_OFFER_MS],
        )
        ends_at = time.monotonic() + self.wait_s
        self._offers[(stream, held.entry_id)] = Offer(
            held, member, partition.offers, stream, ends_at
        )
        log_event(logger, logging.INFO, "lora_job_offered", job=held.job_id, adapter=adapter)

    async def _held_by_peers(self) -> set[str]:
        """The adapters another live worker of the model holds resident with room."""
        if time.monotonic() - self._peers_read_at >= PEERS_MAX_AGE_S:
            self._peers = await self._read_peers()
            self._peers_read_at = time.monotonic()
        return {
            adapter
            for peer in self._peers
            if peer.name != self.consumer and peer.has_room()
            for adapter in peer.lora_resident
        }

    async def _read_peers(self) -> list[WorkerInfo]:
        """Heartbeats of the consumers of the model's first jobs stream (every worker of the
        model reads it); a worker whose heartbeat expired is no peer."""
        try:
            consumers = await self.redis.xinfo_consumers(self._partitions[0].jobs, self.keys.group)
        except ResponseError:  # no stream or group yet
            return []
        names = [as_text(c["name"]) for c in consumers if as_text(c["name"]) != self.consumer]
        if not names:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(self.keys.worker(name))
            hashes = await pipe.execute()
        peers = []
        for data in hashes:
            if not data:
                continue
            try:
                peers.append(WorkerInfo.from_redis_hash(data))
            except ValueError:  # a heartbeat this version cannot read is no peer to wait for
                continue
        return peers
