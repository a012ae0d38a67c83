"""The one thread that builds the engine and runs every step.

The engine is not thread-safe, and libgomp gives each thread that runs torch ops its own OpenMP
team. Two teams (say, one from loading the model on this thread, one stepping) hold more OpenMP
threads than there are cores, and libgomp then all but stops spin-waiting: every parallel region
of a step wakes its threads through the kernel, ~7-10% of step time on 2 cores."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from engine.outputs import RequestDelta
from worker.engine_api import EngineLike, build_engine
from worker.settings import WorkerSettings

# How long the loop waits, at most, for the engine thread to begin a step it was handed.
STEP_START_WAIT_S = 0.005


class EngineThread:
    """Builds the engine (`build`) and runs its steps (`step`) on one thread of its own."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._step_began = threading.Event()  # set by the engine thread as it begins a step

    def build(self, settings: WorkerSettings) -> EngineLike:
        """The engine the settings describe, loaded on the engine thread (blocking)."""
        try:
            return self._executor.submit(build_engine, settings).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise

    async def step(self, engine: EngineLike) -> tuple[list[RequestDelta], float, float]:
        """One `engine.step()`: its deltas, and when it began and ended on the engine thread
        (the loop's own timing would add the thread handoffs to the step)."""
        loop = asyncio.get_running_loop()
        self._step_began.clear()
        running = loop.run_in_executor(self._executor, self._timed_step, engine)
        # Blocking the loop until the engine thread holds the GIL lets the step begin at
        # once: otherwise it waits behind the Python of the Redis round that comes next.
        self._step_began.wait(STEP_START_WAIT_S)
        return await running

    def _timed_step(self, engine: EngineLike) -> tuple[list[RequestDelta], float, float]:
        began = time.perf_counter()
        self._step_began.set()
        deltas = engine.step()
        return deltas, began, time.perf_counter()

    def shutdown(self) -> None:
        """Wait for a step still running, then end the thread."""
        self._executor.shutdown(wait=True)
