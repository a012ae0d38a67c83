"""Running one of `schemas.redis_scripts`' Lua scripts by EVALSHA: Redis is sent the script's
SHA1, not its text, and loads the text only when it does not know it (after a restart, or on a
master a failover just promoted), through EVAL, which also caches it for the next call.

Scripts queued in a pipeline go as EVALSHA with the script's SCRIPT LOAD earlier in the same
pipeline (the worker's outbox loads only when it cannot know Redis has them; its hand-back
always), or as redis-py's registered script, which loads them before the pipeline runs (an
enqueue with a replica WAIT): a NOSCRIPT reply inside a pipeline could not be retried without
re-sending the writes around it. On a cluster a SCRIPT LOAD has no key to route it by: the
worker's outbox sends a script whole to each primary the first time, by EVALSHA after that, and
re-sends only the script ops that met NOSCRIPT."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cache
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

ScriptArg = str | int | float | bytes


@cache
def script_sha(script: str) -> str:
    """The SHA1 Redis names `script` by (computed once per script text)."""
    return hashlib.sha1(script.encode()).hexdigest()


def evalsha_command(
    script: str, keys: Sequence[str], args: Sequence[ScriptArg] = ()
) -> tuple[ScriptArg, ...]:
    """The EVALSHA of `script` on `keys` and `args`, for a pipeline that loads it first."""
    return ("EVALSHA", script_sha(script), len(keys), *keys, *args)


def load_command(script: str) -> tuple[str, ...]:
    """SCRIPT LOAD of `script`: in a pipeline, every EVALSHA after it finds the script."""
    return ("SCRIPT", "LOAD", script)


async def run_script(
    redis: Redis, script: str, keys: Sequence[str], args: Sequence[ScriptArg] = ()
) -> Any:  # a Lua reply: the script decides its shape, and its caller decodes it
    """Run `script` on `keys` and `args` by EVALSHA; on NOSCRIPT, by EVAL (once)."""
    try:
        return await redis.execute_command("EVALSHA", script_sha(script), len(keys), *keys, *args)
    except NoScriptError:
        return await redis.execute_command("EVAL", script, len(keys), *keys, *args)
