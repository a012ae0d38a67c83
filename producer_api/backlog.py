"""The backlog of a model's queue: the entries its partition streams hold (queued or running),
summed; what the queue-length limit is compared with. Both enqueue paths
(producer_api.job_enqueue on one node, producer_api.cluster_queue on a cluster) and the batch
fan-out read it here."""

from __future__ import annotations

from redis.asyncio import Redis

from schemas import RedisKeys


async def queue_length(redis: Redis, keys: RedisKeys, model: str, *, bulk: bool = False) -> int:
    """Jobs of `model` queued or running on its interactive stream (what max_queue_len is
    compared with), or on its bulk stream."""
    streams = keys.bulk_streams(model) if bulk else keys.jobs_streams(model)
    if len(streams) == 1:
        return await redis.xlen(streams[0])
    async with redis.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xlen(stream)
        return sum(await pipe.execute())
