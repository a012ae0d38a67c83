"""Leases: a live worker keeps its pending entries fresh; entries that go stale belong to dead
workers and are taken over (XAUTOCLAIM, see `StreamReader.autoclaim`)."""

from __future__ import annotations

from redis.asyncio import Redis

from schemas import RedisKeys


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
