"""A faster process runtime for CPU inference: a caching allocator and pinned OpenMP threads.

Freed multi-MB activation buffers must stay with the process: glibc malloc and jemalloc's
defaults hand (some of) them back to the OS and page-fault them in again every step (jemalloc:
every page of each buffer over 8 MiB; 1M faults and ~15% of the time of a 24-prompt run).
tcmalloc keeps them; jemalloc does once told never to purge. OpenMP threads that migrate
between cores lose their caches. Large tensors go on transparent huge pages where the kernel
allows them (torch's THP_MEM_ALLOC_ENABLE for the weights and activations; the KV cache, mapped
outside torch's allocator, asks for its own in engine.kv_cache): a decode step reads KV blocks
scattered over gigabytes, and on 4 KiB pages nearly every block costs a TLB miss. All are
environment settings that must be in place when the process starts, so the launcher
re-executes itself once with them (`reexec_with_cpu_runtime`).

A queue worker also runs an asyncio event loop that wakes between and during engine steps. With
bound OpenMP threads, it would share the first core with the thread that steps the engine, and
each step would wait for the loop to yield that core. So the worker moves its loop to the last
core (`move_to_last_core`), whose OpenMP thread idles whenever the engine is not in a parallel
region, and shortens OpenMP's spin-wait (libgomp's default spins for milliseconds), so that the
idle OpenMP thread yields that core to the loop. The loop also runs at a lower priority than the
engine's threads (`lower_event_loop_priority`): a step's threads split its work evenly, so the
loop (sending chunks, reading jobs) taking the last core in the middle of a parallel region
stalls every thread at its end, while at a lower priority it runs in the gaps between regions
(measured on 2 cores: a side load of 10% of one core cost the engine 10% of its throughput at
equal priority, 2% at nice 19).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

TUNED_MARKER = "INFERQ_CPU_RUNTIME_TUNED"  # set in the re-executed process
DISABLE_ENV = "INFERQ_CPU_TUNE"  # "0" keeps the process as it was started
# libgomp spin iterations before an idle OpenMP thread sleeps: a fraction of a millisecond, long
# enough to bridge the gaps between the parallel regions of one step
EVENT_LOOP_SPIN_COUNT = "10000"
# How much nicer than the engine's threads a worker's event loop runs (Linux: per thread)
EVENT_LOOP_NICENESS = 10

_ALLOCATORS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
)


def find_allocator() -> str | None:
    return next((path for path in _ALLOCATORS if Path(path).exists()), None)


def cpu_runtime_env(
    threads: int | None, bind_threads: bool, event_loop: bool = False
) -> dict[str, str]:
    """The environment of a tuned process (the current one plus allocator and OpenMP settings).

    Bind threads only for a process that owns the cores: two processes bound to the same first
    cores would share them while the rest of the machine idles. `event_loop`: the process also
    runs an event loop beside the engine (a queue worker), which idle OpenMP threads must not
    keep off its core by spinning.
    """
    env = dict(os.environ)
    env[TUNED_MARKER] = "1"
    allocator = find_allocator()
    if allocator and allocator not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = f"{allocator} {env.get('LD_PRELOAD', '')}".strip()
    if allocator and "jemalloc" in allocator:
        # The process keeps its high-water mark (bounded by max_num_batched_tokens), as a GPU
        # caching allocator does.
        env.setdefault("MALLOC_CONF", "dirty_decay_ms:-1,muzzy_decay_ms:-1")
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if threads:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    if bind_threads:
        env.setdefault("OMP_PROC_BIND", "close")
        env.setdefault("OMP_PLACES", "cores")
        env.setdefault("KMP_AFFINITY", "granularity=fine,compact,1,0")
        if event_loop:
            env.setdefault("GOMP_SPINCOUNT", EVENT_LOOP_SPIN_COUNT)
    return env


# What cpu_runtime_env adds beside LD_PRELOAD's allocator and the thread count.
_TUNING_KEYS = (
    TUNED_MARKER,
    "MALLOC_CONF",
    "THP_MEM_ALLOC_ENABLE",
    "OMP_PROC_BIND",
    "OMP_PLACES",
    "KMP_AFFINITY",
    "GOMP_SPINCOUNT",
)


def untuned_env(env: dict[str, str]) -> dict[str, str]:
    """`env` without the tuning a benchmark process re-executed under: for the children that
    run without it in production (the API, the batch controller), so that their memory is
    measured as it would be there (the tuned allocator never returns freed pages)."""
    untuned = {key: value for key, value in env.items() if key not in _TUNING_KEYS}
    allocator = find_allocator()
    if allocator and "LD_PRELOAD" in untuned:
        kept = [path for path in untuned["LD_PRELOAD"].split() if path != allocator]
        untuned["LD_PRELOAD"] = " ".join(kept)
        if not kept:
            del untuned["LD_PRELOAD"]
    return untuned


def reexec_with_cpu_runtime(
    threads: int | None, bind_threads: bool, event_loop: bool = False
) -> None:
    """Replace this process by itself (same command line) under `cpu_runtime_env`, once.

    Returns without doing anything when INFERQ_CPU_TUNE=0, or when the environment is already
    tuned as asked (a worker started by a tuned benchmark still gets its event-loop settings)."""
    if os.environ.get(DISABLE_ENV) == "0":
        return
    env = cpu_runtime_env(threads, bind_threads, event_loop)
    if os.environ.get(TUNED_MARKER) and all(os.environ.get(k) == v for k, v in env.items()):
        logger.info("cpu runtime: %s", describe_cpu_runtime())
        return
    logger.debug("re-executing with LD_PRELOAD=%s", env.get("LD_PRELOAD", ""))
    # orig_argv keeps `-m package` forms intact, which sys.argv has already rewritten.
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def describe_cpu_runtime() -> str:
    preload = os.environ.get("LD_PRELOAD", "")
    allocator = Path(preload.split()[0]).name if preload else "glibc malloc"
    binding = os.environ.get("OMP_PROC_BIND", "unbound")
    threads = os.environ.get("OMP_NUM_THREADS", "-")
    described = f"allocator={allocator} OMP_NUM_THREADS={threads} OMP_PROC_BIND={binding}"
    if os.environ.get("MALLOC_CONF"):
        described += f" MALLOC_CONF={os.environ['MALLOC_CONF']}"
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1":
        described += " huge pages"
    if os.environ.get("GOMP_SPINCOUNT"):
        described += f" GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}"
    return described


def move_to_last_core(cores: set[int]) -> bool:
    """Pin the calling thread to the last of `cores` (the cores the process may use, read
    before OpenMP bound its first thread), when OpenMP threads are bound and there is more than
    one core; True if it moved. The first core belongs to the thread that steps the engine."""
    if len(cores) < 2 or not os.environ.get("OMP_PROC_BIND"):
        return False
    os.sched_setaffinity(0, {max(cores)})
    return True


def lower_event_loop_priority() -> bool:
    """Make the calling thread (a CPU worker's event loop) EVENT_LOOP_NICENESS nicer than it is,
    on Linux, in a process running under the tuned CPU runtime; True if it did. Threads it
    starts later inherit that, so the engine's thread must exist already (it also starts the
    OpenMP threads of every step)."""
    if sys.platform != "linux" or not os.environ.get(TUNED_MARKER):
        return False
    thread = threading.get_native_id()  # on Linux the niceness of one thread
    current = os.getpriority(os.PRIO_PROCESS, thread)
    os.setpriority(os.PRIO_PROCESS, thread, min(19, current + EVENT_LOOP_NICENESS))
    return True


def no_gpu_visible() -> bool:
    """True when no NVIDIA device node exists (decided without importing torch)."""
    return not any(Path("/dev").glob("nvidia[0-9]*"))
