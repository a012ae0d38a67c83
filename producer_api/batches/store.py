"""The batch hash `{p}:batch:{id}`: create, read, status changes (compare-and-set), listing."""

from __future__ import annotations

import json
import time

from redis.asyncio import Redis

from redis_io.clients import pipeline
from redis_io.scripts import run_script
from schemas import BatchField, BatchObject, BatchStatus, RedisKeys
from schemas.batches import STATUS_TIME_FIELD, is_valid_batch_id, new_batch_id
from schemas.redis_scripts import BATCH_SET_STATUS_SCRIPT, BATCH_STATUS_ARGS_END

CANCELLABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


def now_s() -> int:
    return int(time.time())


class BatchStore:
    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self.redis = redis
        self.keys = keys

    async def create(
        self,
        *,
        owner: str | None,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        window_s: int,
        metadata: dict[str, str] | None,
    ) -> BatchObject:
        batch_id = new_batch_id()
        created = now_s()
        fields = {
            BatchField.ID: batch_id,
            BatchField.OWNER: owner or "",
            BatchField.ENDPOINT: endpoint,
            BatchField.INPUT_FILE_ID: input_file_id,
            BatchField.COMPLETION_WINDOW: completion_window,
            BatchField.STATUS: BatchStatus.VALIDATING.value,
            BatchField.CREATED_AT: created,
            BatchField.EXPIRES_AT: created + window_s,
            BatchField.TOTAL: 0,
            BatchField.COMPLETED: 0,
            BatchField.FAILED: 0,
            BatchField.SUBMITTED: 0,
        }
        if metadata:
            fields[BatchField.METADATA] = json.dumps(metadata)
        async with pipeline(self.redis, atomic=True) as pipe:
            pipe.hset(self.keys.batch(batch_id), mapping={str(k): v for k, v in fields.items()})
            pipe.sadd(self.keys.active_batches(), batch_id)
            pipe.zadd(self.keys.batches_of(owner), {batch_id: created})
            await pipe.execute()
        return await self.get(batch_id)  # type: ignore[return-value]

    async def raw(self, batch_id: str) -> dict[str, str]:
        if not is_valid_batch_id(batch_id):
            return {}
        return await self.redis.hgetall(self.keys.batch(batch_id))

    async def get(self, batch_id: str) -> BatchObject | None:
        data = await self.raw(batch_id)
        return BatchObject.from_redis_hash(data) if data else None

    async def running_on(self, input_file_id: str) -> str | None:
        """A batch still running on this input file (it re-reads the file as it goes)."""
        batch_ids = list(await self.redis.smembers(self.keys.active_batches()))
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hmget(self.keys.batch(batch_id), [BatchField.INPUT_FILE_ID, BatchField.STATUS])
            rows = await pipe.execute()
        for batch_id, (file_id, status) in zip(batch_ids, rows, strict=True):
            if file_id == input_file_id and status and not BatchStatus(status).is_terminal:
                return batch_id
        return None

    async def owner_of(self, batch_id: str) -> str | None:
        return (await self.redis.hget(self.keys.batch(batch_id), BatchField.OWNER)) or None

    async def set_status(
        self,
        batch_id: str,
        status: BatchStatus,
        allowed_from: tuple[BatchStatus, ...],
        **extra: str | int,
    ) -> tuple[bool, BatchStatus | None]:
        """Compare-and-set the status (and its `*_at` time); (applied, previous or current)."""
        time_field = STATUS_TIME_FIELD.get(status)
        args: list[str | int] = [status.value, time_field.value if time_field else "", now_s()]
        args += [s.value for s in allowed_from] + [BATCH_STATUS_ARGS_END]
        for name, value in extra.items():
            args += [name, value]
        batch_key = self.keys.batch(batch_id)
        applied, seen = await run_script(self.redis, BATCH_SET_STATUS_SCRIPT, [batch_key], args)
        return bool(applied), BatchStatus(seen) if seen else None

    async def list(
        self, owner: str | None, *, limit: int, after: str | None
    ) -> tuple[list[BatchObject], bool]:
        """Newest first; `after`: a batch id from the previous page. (batches, has_more)."""
        key = self.keys.batches_of(owner)
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(key, after)
            start = 0 if rank is None else rank + 1
        ids = await self.redis.zrevrange(key, start, start + limit)
        batches = []
        for batch_id in ids[:limit]:
            batch = await self.get(batch_id)
            if batch is not None:
                batches.append(batch)
        return batches, len(ids) > limit
