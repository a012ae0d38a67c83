"""Process entry of a worker, which `inferq worker` calls with the settings it parsed.

SIGTERM and SIGINT stop pulling, let running jobs finish for up to the drain timeout, hand the
rest back to the queue and exit 0; a second signal ends the drain at once.
"""

from __future__ import annotations

import asyncio
import os
import signal

from worker.settings import WorkerSettings


def run_worker(settings: WorkerSettings) -> int:
    """Run a worker until SIGTERM / SIGINT (`inferq worker` parses the settings)."""
    cores = os.sched_getaffinity(0)  # before importing torch, whose OpenMP binds this thread
    config = settings.engine_config()
    # Tensor-parallel ranks sharing a host run one thread each unless told otherwise.
    threads = config.num_threads or (1 if config.tensor_parallel_size > 1 else None)
    tune_cpu_process(config.device, threads)
    from engine.distributed.group import is_torchrun_executor

    if is_torchrun_executor(config.tensor_parallel_size):
        from engine.distributed.executor import run_executor

        return run_executor(config)  # torchrun started this rank: it only executes steps
    return asyncio.run(serve(settings, cores))


def tune_cpu_process(device: str, num_threads: int | None) -> None:
    """On the CPU, restart this process once with a caching allocator; pin OpenMP threads too
    when the worker uses every core (several workers sharing a host must not pin to the same
    cores). See engine.platforms.cpu.runtime."""
    from engine.platforms.cpu.runtime import no_gpu_visible, reexec_with_cpu_runtime

    if device == "cpu" or (device == "auto" and no_gpu_visible()):
        owns_cores = num_threads is None or num_threads >= (os.cpu_count() or 1)
        reexec_with_cpu_runtime(num_threads, bind_threads=owns_cores, event_loop=True)


async def serve(settings: WorkerSettings, cores: set[int]) -> int:
    """Load the engine, serve until SIGTERM / SIGINT, drain, hand back, return 0. `cores`: the
    cores this process may use; once the engine is up the event loop moves to the last one, at a
    lower priority than the engine's threads."""
    from engine.platforms.cpu.runtime import lower_event_loop_priority, move_to_last_core
    from worker.worker import Worker

    workers: list[Worker] = []

    def stop() -> None:
        for worker in workers:
            worker.request_stop()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop)  # a signal during the model load acts after it
    workers.append(Worker(settings))  # loads the model (blocking), on the engine's thread
    move_to_last_core(cores)
    lower_event_loop_priority()
    await workers[0].run()
    return 0
