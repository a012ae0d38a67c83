"""Leases: a live worker keeps its pending entries fresh; entries that go stale belong to dead
workers and are taken over (XAUTOCLAIM, see `StreamReader.autoclaim`). A worker known dead (its
heartbeat hash expired, and it has not touched the stream since) has its entries taken over at
once (`dead_consumers`, `StreamReader.claim_from`) rather than when their lease runs out."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from schemas import RedisKeys
from schemas.jobs import as_text


async def renew_leases(
    redis: Redis, keys: RedisKeys, stream: str, consumer: str, entry_ids: set[str]
) -> set[str]:
    """Reset the idle time of the held entries this consumer still owns; returns the held
    entries it no longer owns (another worker claimed them: stop running those jobs).

    XCLAIM with min-idle 0 would also steal entries back from whoever claimed them, so only the
    entries XPENDING still lists under this consumer are renewed."""
    if not entry_ids:
        return set()
    ordered = sorted(entry_ids, key=_entry_order)
    pending = await redis.xpending_range(
        stream,
        keys.group,
        min=ordered[0],
        max=ordered[-1],
        count=len(ordered) * 4 + 100,
        consumername=consumer,
    )
    owned = {item["message_id"] for item in pending} & entry_ids
    if owned:
        await redis.xclaim(stream, keys.group, consumer, 0, sorted(owned), justid=True)
    return entry_ids - owned


def _entry_order(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq or 0)


async def dead_consumers(
    redis: Redis, keys: RedisKeys, stream: str, me: str, min_silence_ms: int
) -> list[str]:
    """The consumers on `stream` holding pending entries whose worker is known dead: its
    heartbeat hash is gone (it stopped beating for the heartbeat's TTL) and it has not touched
    the stream for `min_silence_ms`. A live worker beats every few seconds and reads far more
    often, so neither holds for it; dead consumers holding nothing are dropped from the group
    (they would otherwise pile up, one per worker start)."""
    try:
        consumers = await redis.xinfo_consumers(stream, keys.group)
    except ResponseError:  # no stream or group yet
        return []
    silent = [
        (as_text(info["name"]), int(info["pending"]))
        for info in consumers
        if as_text(info["name"]) != me and int(info["idle"]) >= min_silence_ms
    ]
    if not silent:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for name, _ in silent:
            pipe.exists(keys.worker(name))
        beating = await pipe.execute()
    dead = [entry for entry, alive in zip(silent, beating, strict=True) if not alive]
    for name, pending in dead:
        if pending == 0:
            await redis.xgroup_delconsumer(stream, keys.group, name)
    return [name for name, pending in dead if pending > 0]
