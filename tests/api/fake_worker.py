"""A minimal worker that follows the Redis contract, for testing the producer side.

It "generates" by echoing the prompt's words one chunk at a time, so every expected output is
computed from the request, never hard-coded."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from schemas import (
    OUT_STREAM_MAXLEN,
    OUT_STREAM_TTL_S,
    TRANSITION_SCRIPT,
    ChoiceResult,
    Job,
    JobResult,
    JobStatus,
    RedisKeys,
    Timings,
    TokenChunk,
    Usage,
    chunk_stream_id,
    transition_applied,
    transition_call,
    utc_now,
)
from schemas.chunks import REPLAY_FIELD
from schemas.keys import JOB_ENTRY_FIELD


def echo_pieces(job: Job) -> list[str]:
    """The text deltas the fake worker produces for a job: the prompt's words."""
    words = job.request.prompt.split(" ")
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


@dataclass
class Claimed:
    job: Job
    entry_id: str
    stream: str  # the stream the entry came from (the jobs stream, or the bulk stream)


class FakeWorker:
    def __init__(self, redis: Redis, keys: RedisKeys, model: str, name: str = "fake-1") -> None:
        self.redis = redis
        self.keys = keys
        self.model = model
        self.name = name
        self.stream = keys.jobs_stream(model)
        # a job of priority PRIORITY_BULK or more is queued on the bulk stream, read after
        self.streams = (self.stream, keys.bulk_stream(model))

    async def create_group(self) -> None:
        try:
            for stream in self.streams:
                await self.redis.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def claim(self, block_ms: int = 2000) -> Claimed | None:
        """Read one entry and start its job (None when nothing came or the job was cancelled)."""
        reply = await self.redis.xreadgroup(self.keys.group, self.name, {self.stream: ">"}, count=1)
        if not reply:  # interactive work first, as a real worker takes it
            reply = await self.redis.xreadgroup(
                self.keys.group, self.name, {s: ">" for s in self.streams}, count=1, block=block_ms
            )
        if not reply:
            return None
        stream, entries = reply[0]
        entry_id, fields = entries[0]
        job_id = fields[JOB_ENTRY_FIELD]
        keys_, args = transition_call(
            self.keys, job_id, JobStatus.RUNNING, {"started_at": utc_now(), "worker": self.name}
        )
        applied, _ = transition_applied(await self.redis.eval(TRANSITION_SCRIPT, 2, *keys_, *args))
        if not applied:
            await self._done(entry_id, stream)
            return None
        await self.redis.hincrby(self.keys.job(job_id), "attempts", 1)
        job = Job.from_redis_hash(await self.redis.hgetall(self.keys.job(job_id)))
        return Claimed(job, entry_id, stream)

    async def publish(
        self, chunks: list[TokenChunk], *, live: bool = True, replay: bool = True
    ) -> None:
        """One pipeline per step: XADD to the replay stream, then PUBLISH (either can be
        skipped to simulate a lost message)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for chunk in chunks:
                wire = chunk.to_json()
                if replay:
                    pipe.xadd(
                        self.keys.out_stream(chunk.job_id),
                        {REPLAY_FIELD: wire},
                        id=chunk_stream_id(chunk.index),
                        maxlen=OUT_STREAM_MAXLEN,
                        approximate=True,
                    )
                    pipe.expire(self.keys.out_stream(chunk.job_id), OUT_STREAM_TTL_S)
                if live:
                    pipe.publish(self.keys.channel(chunk.job_id), wire)
            replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            # the replay stream refuses a chunk index it already holds: that is the point
            if isinstance(reply, ResponseError) and "equal or smaller" not in str(reply):
                raise reply

    def chunks_of(self, job: Job) -> list[TokenChunk]:
        pieces = echo_pieces(job)
        return [
            TokenChunk(
                job_id=job.id,
                index=i,
                text=piece,
                token_ids=[len(piece)],
                finish_reason="stop" if i == len(pieces) - 1 else None,
                final=i == len(pieces) - 1,
            )
            for i, piece in enumerate(pieces)
        ]

    async def finish(self, claimed: Claimed, chunks: list[TokenChunk]) -> bool:
        """Store the result built from `chunks`; False when the job had been ended meanwhile."""
        job = claimed.job
        result = JobResult(
            choices=[
                ChoiceResult(
                    index=0,
                    text="".join(c.text for c in chunks),
                    token_ids=[t for c in chunks for t in c.token_ids],
                    finish_reason="stop",
                )
            ],
            usage=Usage.of(len(echo_pieces(job)), sum(len(c.token_ids) for c in chunks)),
            timings=Timings.from_times(job.created_at, job.started_at, job.started_at, utc_now()),
        )
        keys_, args = transition_call(
            self.keys, job.id, JobStatus.SUCCEEDED, {"result": result, "finished_at": utc_now()}
        )
        applied, _ = transition_applied(await self.redis.eval(TRANSITION_SCRIPT, 2, *keys_, *args))
        await self._done(claimed.entry_id, claimed.stream)
        return applied

    async def _done(self, entry_id: str, stream: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(stream, self.keys.group, entry_id)
            pipe.xdel(stream, entry_id)
            await pipe.execute()

    async def serve_one(self) -> Claimed | None:
        """Claim a job and run it to the end, a chunk per step."""
        claimed = await self.claim()
        if claimed is None:
            return None
        chunks = self.chunks_of(claimed.job)
        for chunk in chunks:
            await self.publish([chunk])
        await self.finish(claimed, chunks)
        return claimed
