"""Follow a job as it runs, over its pub/sub channel: wait until it ends (wait_job), or stream
its token chunks, each once and in order (stream_chunks). Both subscribe before they read, and
fall back on the job hash and its replay stream for any message pub/sub lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from producer_api.job_record import get_job
from producer_api.queue_errors import JobNotFoundError, QueueError
from redis_io.clients import pipeline
from redis_io.pubsub import job_pubsub
from schemas import (
    ErrorBody,
    ErrorCode,
    Job,
    JobStatus,
    RedisKeys,
    StatusEvent,
    TokenChunk,
    is_valid_job_id,
    parse_channel_message,
    replay_start_after,
)
from schemas.chunks import REPLAY_FIELD, chunk_stream_id
from schemas.jobs import JobField, as_text

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 1.0
SUBSCRIBE_TIMEOUT_S = 5.0


@asynccontextmanager
async def _subscribed(redis: Redis, channel: str) -> AsyncIterator[PubSub]:
    """A pubsub on `channel` whose subscription the server has confirmed, so no message
    published after this point is missed."""
    pubsub = await job_pubsub(redis, channel)
    try:
        await pubsub.subscribe(channel)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + SUBSCRIBE_TIMEOUT_S
        while True:
            message = await pubsub.get_message(timeout=max(give_up - loop.time(), 0.0))
            if message is not None and message["type"] in ("subscribe", b"subscribe"):
                break
            if loop.time() >= give_up:
                raise QueueError(
                    ErrorBody.of(ErrorCode.UNAVAILABLE, f"could not subscribe to {channel}")
                )
        yield pubsub
    finally:
        await pubsub.aclose()


def _ends_job(message: TokenChunk | StatusEvent) -> bool:
    if isinstance(message, TokenChunk):
        return message.final
    return message.status.is_terminal


def _parse_live(data: str | bytes) -> TokenChunk | StatusEvent | None:
    try:
        return parse_channel_message(data)
    except ValueError:
        log.warning("ignoring an unreadable message on a job channel: %.200r", data)
        return None


async def wait_job(
    redis: Redis,
    keys: RedisKeys,
    job_id: str,
    *,
    timeout: float | None = None,
    poll_interval: float = DEFAULT_POLL_INTERVAL_S,
) -> Job:
    """Wait until the job reaches a terminal status and return it. After `timeout` seconds the
    job is returned as it is then (check `job.status.is_terminal`). Wakes on the job channel's
    final chunk or status event, and re-reads the hash every `poll_interval` in case a pub/sub
    message was lost."""
    if not is_valid_job_id(job_id):
        raise JobNotFoundError(job_id)
    loop = asyncio.get_running_loop()
    give_up = None if timeout is None else loop.time() + timeout
    async with _subscribed(redis, keys.channel(job_id)) as pubsub:
        job = await get_job(redis, keys, job_id)
        next_poll = loop.time() + poll_interval
        while not job.status.is_terminal:
            now = loop.time()
            if give_up is not None and now >= give_up:
                return job
            wake_at = next_poll if give_up is None else min(next_poll, give_up)
            message = await pubsub.get_message(
                ignore_subscribe_messages=True, timeout=max(wake_at - now, 0.0)
            )
            parsed = None if message is None else _parse_live(message["data"])
            if (parsed is not None and _ends_job(parsed)) or loop.time() >= next_poll:
                job = await get_job(redis, keys, job_id)
                next_poll = loop.time() + poll_interval
        return job


class _ChunkCursor:
    """Hands out each chunk index once and in order, however often chunks arrive."""

    def __init__(self, last_index: int) -> None:
        self.last_index = last_index
        self.finished = False

    def fresh(self, chunks: list[TokenChunk]) -> list[TokenChunk]:
        out = []
        for chunk in chunks:
            if self.finished or chunk.index <= self.last_index:
                continue
            if chunk.index > self.last_index + 1:
                log.warning(
                    "job %s: chunks %d..%d are gone from the replay stream",
                    chunk.job_id,
                    self.last_index + 1,
                    chunk.index - 1,
                )
            out.append(chunk)
            self.last_index = chunk.index
            self.finished = chunk.final
        return out


async def _replay(
    redis: Redis, keys: RedisKeys, job_id: str, after: int, upto: int | None = None
) -> list[TokenChunk]:
    end = "+" if upto is None else chunk_stream_id(upto)
    entries = await redis.xrange(keys.out_stream(job_id), min=replay_start_after(after), max=end)
    return [_chunk_of_entry(fields) for _, fields in entries]


async def _status_and_replay(
    redis: Redis, keys: RedisKeys, job_id: str, after: int
) -> tuple[JobStatus | None, list[TokenChunk]]:
    """One consistent snapshot (MULTI; on a cluster, both keys on the job's node, read in this
    order: a job's chunks are all written before its final status) of the job's status and its
    chunks after `after`."""
    async with pipeline(redis, atomic=True) as pipe:
        pipe.hget(keys.job(job_id), JobField.STATUS)
        pipe.xrange(keys.out_stream(job_id), min=replay_start_after(after), max="+")
        status, entries = await pipe.execute()
    chunks = [_chunk_of_entry(fields) for _, fields in entries]
    return (None if status is None else JobStatus(as_text(status))), chunks


def _chunk_of_entry(fields: Mapping[str | bytes, str | bytes]) -> TokenChunk:
    raw = fields.get(REPLAY_FIELD)
    if raw is None:
        raw = fields[REPLAY_FIELD.encode()]
    return TokenChunk.from_json(raw)


async def stream_chunks(
    redis: Redis,
    keys: RedisKeys,
    job_id: str,
    *,
    last_index: int = -1,
    poll_interval: float = DEFAULT_POLL_INTERVAL_S,
) -> AsyncIterator[TokenChunk]:
    """Every chunk of the job after `last_index`, each exactly once and in index order, live.

    Subscribes to the job channel first, then replays the replay stream, then follows live
    messages; a gap in the live numbering is filled from the replay stream. Ends after the final
    chunk, or once the job is terminal (status event, or a poll every `poll_interval`) and the
    replay stream is drained. Raises JobNotFoundError for an unknown job."""
    if not is_valid_job_id(job_id):
        raise JobNotFoundError(job_id)
    cursor = _ChunkCursor(last_index)
    loop = asyncio.get_running_loop()
    async with _subscribed(redis, keys.channel(job_id)) as pubsub:
        status, replayed = await _status_and_replay(redis, keys, job_id, cursor.last_index)
        if status is None:
            raise JobNotFoundError(job_id)
        for chunk in cursor.fresh(replayed):
            yield chunk
        ended = status.is_terminal
        next_poll = loop.time() + poll_interval
        while not (ended or cursor.finished):
            message = await pubsub.get_message(
                ignore_subscribe_messages=True, timeout=max(next_poll - loop.time(), 0.0)
            )
            parsed = None if message is None else _parse_live(message["data"])
            if isinstance(parsed, TokenChunk) and parsed.index > cursor.last_index:
                batch = [parsed]
                if parsed.index > cursor.last_index + 1:
                    # A live message was lost: the replay stream has everything up to this one.
                    batch = await _replay(redis, keys, job_id, cursor.last_index, parsed.index)
                    batch.append(parsed)
                for chunk in cursor.fresh(batch):
                    yield chunk
            elif (parsed is not None and _ends_job(parsed)) or loop.time() >= next_poll:
                status, replayed = await _status_and_replay(redis, keys, job_id, cursor.last_index)
                for chunk in cursor.fresh(replayed):
                    yield chunk
                ended = status is None or status.is_terminal
                next_poll = loop.time() + poll_interval
