"""A fan-out round's jobs enqueued in one pipelined round trip, each as producer_api.queue's
`enqueue` would (the same script, the same idempotency key), rather than a coroutine and a round
trip per line: at thousands of lines a second those cost the controller more than the jobs."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from producer_api import queue
from redis_io.scripts import evalsha_command, load_command
from schemas import Job, JobRequest, RedisKeys
from schemas.redis_connection import ReplicaWait
from schemas.redis_scripts import ENQUEUE_SCRIPT


async def enqueue_all(
    redis: Redis,
    keys: RedisKeys,
    requests: list[JobRequest],
    *,
    owner: str | None,
    replicas: ReplicaWait | None,
) -> list[Job | BaseException]:
    """Each request's job (an earlier one's, for an idempotency key seen before), or what
    `enqueue` would raise for it: a QueueError for a request refused, another exception for
    Redis trouble. In order; no queue-length cap (bulk work waits on its own stream)."""
    if keys.cluster or replicas is not None:  # routed per key, or a WAIT per write
        calls = (queue.enqueue(redis, keys, r, owner=owner, replicas=replicas) for r in requests)
        return list(await asyncio.gather(*calls, return_exceptions=True))
    results: list[Job | BaseException | None] = [None] * len(requests)
    jobs: list[tuple[int, Job]] = []
    for index, request in enumerate(requests):
        try:
            queue.check_deadline(request)
        except queue.QueueError as exc:
            results[index] = exc
            continue
        jobs.append((index, Job.new(request, owner=owner)))
    if jobs:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.execute_command(*load_command(ENQUEUE_SCRIPT))
            for _, job in jobs:
                script_keys, args = queue.enqueue_call(keys, job, owner=owner, max_queue_len=None)
                pipe.execute_command(*evalsha_command(ENQUEUE_SCRIPT, script_keys, args))
            replies = await pipe.execute(raise_on_error=False)
        for (index, job), reply in zip(jobs, replies[1:], strict=True):
            if isinstance(reply, BaseException):
                results[index] = reply
                continue
            try:
                results[index] = await queue.enqueued(redis, keys, job, *reply, None)
            except Exception as exc:  # refused, or its earlier job unreadable: this line only
                results[index] = exc
    return [result for result in results if result is not None]
