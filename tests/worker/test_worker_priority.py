"""A CPU worker's event loop runs nicer than its engine's threads, so the Redis work around each
step (chunks out, jobs in) fills the gaps between the step's parallel regions instead of
stalling them; the engine's own thread keeps the process's priority."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from redis.asyncio import Redis
from worker_harness import KEYS, start_worker_process, stop_process, wait_for

from engine.platforms.cpu.runtime import EVENT_LOOP_NICENESS

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's"),
]


def _niceness(pid: int, tid: int) -> int:
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])  # field 19, counted after the command name


async def test_the_event_loop_runs_nicer_than_the_engine_thread(redis_url):
    redis = Redis.from_url(redis_url, decode_responses=True)
    worker = start_worker_process(redis_url, fake=True, model="nice-model", name="nice-worker")
    try:
        await wait_for(lambda: redis.exists(KEYS.worker("nice-worker")), 60)
        own = os.getpriority(os.PRIO_PROCESS, 0)  # the worker inherits the test's niceness
        niceness = {
            int(task.name): _niceness(worker.pid, int(task.name))
            for task in Path(f"/proc/{worker.pid}/task").iterdir()
        }
        assert niceness[worker.pid] == min(19, own + EVENT_LOOP_NICENESS)  # the loop's thread
        assert own in niceness.values()  # the engine's thread, started before the loop yielded
    finally:
        stop_process(worker)
        await redis.aclose()
