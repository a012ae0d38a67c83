"""The start-up look at Redis's memory settings: which keep inferq's keys safe, judged from
`INFO memory`, and the check the API and the worker run once as they start.

Queued work lives in keys without a TTL (the job streams, queued and running job hashes, dead
letters); what a job leaves behind has one (its result hash, its replay stream), and so do
worker heartbeats and idempotency keys. When Redis reaches `maxmemory` it applies
`maxmemory-policy`:

- `noeviction`: commands that would add memory fail (new jobs, results) and nothing stored is
  lost; memory comes back as results and replay streams expire. The only policy under which
  Redis never drops a job.
- `volatile-*`: evicts keys that have a TTL: results clients have not read yet, replay streams of
  running jobs (a resuming stream misses chunks), worker heartbeats (live workers look dead) and
  idempotency keys (a retried request runs twice).
- `allkeys-*`: evicts any key, queued jobs' hashes and whole job streams included.

Without `maxmemory` (0) Redis grows until the host runs out of memory and the kernel kills it.
The check is advice, not a gate: a Redis that does not answer, or an ACL user without INFO
(`-@dangerous`), only gets a line saying it could not be checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from redis.asyncio import Redis
from redis.exceptions import RedisError

SAFE_EVICTION_POLICY = "noeviction"
NEARLY_FULL = 0.9  # of maxmemory: worth a warning at start-up
SIZING_HINT = "see the README's 'Sizing Redis'"

_EVICTS = {
    "volatile": "keys with a TTL: unread results, replay streams of running jobs, worker "
    "heartbeats and idempotency keys",
    "allkeys": "any key, queued jobs and whole job streams included",
}


def redis_memory_warning(info: Mapping[str, object]) -> str | None:
    """What is unsafe about the `maxmemory` and `maxmemory_policy` of an `INFO memory` reply
    (or about how close `used_memory` is to the cap), as one line; None when all is fine."""
    maxmemory = int(str(info.get("maxmemory", 0)))
    policy = str(info.get("maxmemory_policy", SAFE_EVICTION_POLICY))
    fix = f"set maxmemory-policy {SAFE_EVICTION_POLICY}"
    if maxmemory == 0:
        also = "" if policy == SAFE_EVICTION_POLICY else f" and {fix}"
        return (
            "Redis has no maxmemory: it keeps every result and replay stream for its TTL and "
            f"grows until the host runs out of memory; set maxmemory{also} ({SIZING_HINT})"
        )
    if policy != SAFE_EVICTION_POLICY:
        evicts = _EVICTS.get(policy.split("-", 1)[0], "keys")
        return (
            f"Redis maxmemory-policy is {policy}: when full it evicts {evicts}; {fix} "
            f"({SIZING_HINT})"
        )
    used = int(str(info.get("used_memory", 0)))
    if used >= NEARLY_FULL * maxmemory:
        return (
            f"Redis uses {used / maxmemory:.0%} of its maxmemory ({maxmemory} bytes): once full "
            f"it refuses new jobs and results until old ones expire; raise maxmemory ({SIZING_HINT})"
        )
    return None


async def warn_about_redis_memory(
    redis: Redis,
    *,
    on_unsafe: Callable[[str], None],
    on_unchecked: Callable[[Exception], None],
    timeout_s: float | None = None,
) -> None:
    """Read `INFO memory` (waiting `timeout_s` at most; None: as long as the client's own socket
    timeout) and pass what is unsafe about it to `on_unsafe`, as one line; `on_unchecked` gets
    the error when Redis did not answer (or refused INFO). Each caller logs in its own style."""
    try:
        info = await asyncio.wait_for(redis.info("memory"), timeout_s)
    except (RedisError, OSError) as exc:  # TimeoutError is an OSError
        on_unchecked(exc)
        return
    warning = redis_memory_warning(info)
    if warning is not None:
        on_unsafe(warning)
