"""The CPU launcher restarts a process once under a caching allocator, keeping its command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec, num_blocks_for_budget
from engine.platforms.cpu.runtime import (
    EVENT_LOOP_NICENESS,
    EVENT_LOOP_SPIN_COUNT,
    cpu_runtime_env,
    find_allocator,
    lower_event_loop_priority,
    move_to_last_core,
    untuned_env,
)

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import ctypes, json, os, resource, sys
from engine.platforms.cpu.runtime import reexec_with_cpu_runtime
reexec_with_cpu_runtime(2, bind_threads={bind})

def faults_per_page_of_a_reused_buffer(size=24 << 20, rounds=10):
    # what a step does with its activations: allocate, write, free, again
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    def once():
        buffer = libc.malloc(size)
        libc.memset(buffer, 1, size)
        libc.free(buffer)
    once()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        once()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults / rounds / (size // 4096)

print(json.dumps({{"argv": sys.argv[1:], "tuned": os.environ.get("INFERQ_CPU_RUNTIME_TUNED"),
                  "preload": os.environ.get("LD_PRELOAD", ""),
                  "bind": os.environ.get("OMP_PROC_BIND"),
                  "threads": os.environ.get("OMP_NUM_THREADS"),
                  "refaults": faults_per_page_of_a_reused_buffer()}}))
"""


def _run_probe(tmp_path: Path, bind: bool, **env: str) -> dict:
    return _run_probe_source(tmp_path, PROBE.format(bind=bind), **env)


def _run_probe_source(tmp_path: Path, source: str, **env: str) -> dict:
    """Run `source` as `python -m probe one --two` in an untuned environment plus `env`; the
    JSON object its last line prints."""
    (tmp_path / "probe.py").write_text(source)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "KMP_", "GOMP_"))}
    clean.pop("LD_PRELOAD", None)
    clean.pop("MALLOC_CONF", None)
    clean.pop("INFERQ_CPU_RUNTIME_TUNED", None)
    result = subprocess.run(
        [sys.executable, "-m", "probe", "one", "--two"],
        cwd=tmp_path,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_reexec_keeps_the_command_line_and_preloads_the_allocator(tmp_path: Path) -> None:
    seen = _run_probe(tmp_path, bind=False)
    assert seen["argv"] == ["one", "--two"]  # `python -m probe one --two` ran again as is
    assert seen["tuned"] == "1"
    allocator = find_allocator()
    assert seen["preload"] == (allocator or "")
    assert seen["bind"] is None  # a process sharing the host does not pin threads
    assert seen["threads"] == "2"


def test_a_tuned_process_reuses_freed_buffers_without_page_faults(tmp_path: Path) -> None:
    # Each step frees and reallocates multi-MB activations; faulting them in again every time
    # cost ~15% of CPU throughput with jemalloc's default purging.
    assert _run_probe(tmp_path, bind=False)["refaults"] < 0.05


HUGE_PAGE_PROBE = """
import sys
sys.path.insert(0, {repo!r})
from engine.platforms.cpu.runtime import reexec_with_cpu_runtime
reexec_with_cpu_runtime(threads=1, bind_threads=False)
import torch
kv_cache = torch.zeros(64 << 20, dtype=torch.uint8)
rollup = open("/proc/self/smaps_rollup").read()
print(int(rollup.split("AnonHugePages:")[1].split()[0]))
"""


def _huge_pages_allowed() -> bool:
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return setting.exists() and "[never]" not in setting.read_text()


def test_a_tuned_process_keeps_large_tensors_on_huge_pages(tmp_path: Path) -> None:
    # Decode attention reads KV blocks scattered over gigabytes: on 4 KiB pages nearly every
    # block is a TLB miss.
    if not _huge_pages_allowed():
        pytest.skip("transparent huge pages are off on this machine")
    (tmp_path / "probe.py").write_text(HUGE_PAGE_PROBE.format(repo=str(REPO)))
    clean = {k: v for k, v in os.environ.items() if k != "INFERQ_CPU_RUNTIME_TUNED"}
    clean.pop("THP_MEM_ALLOC_ENABLE", None)
    result = subprocess.run(
        [sys.executable, str(tmp_path / "probe.py")],
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    huge_kib = int(result.stdout.strip().splitlines()[-1])
    assert huge_kib >= 32 << 10  # most of the 64 MiB tensor


def test_binding_only_when_asked_and_opt_out(tmp_path: Path) -> None:
    assert _run_probe(tmp_path, bind=True)["bind"] == "close"
    untouched = _run_probe(tmp_path, bind=True, INFERQ_CPU_TUNE="0")
    assert untouched["tuned"] is None and untouched["preload"] == ""


EVENT_LOOP_PROBE = """
import json, os
from engine.platforms.cpu.runtime import reexec_with_cpu_runtime
reexec_with_cpu_runtime(2, bind_threads=True, event_loop=True)
print(json.dumps({"spin": os.environ.get("GOMP_SPINCOUNT"), "bind": os.environ.get("OMP_PROC_BIND")}))
"""


def test_children_a_benchmark_runs_untuned_get_the_plain_allocator_back(monkeypatch) -> None:
    """A benchmark's API and controller run as in production: the tuned allocator never
    returns freed pages, which would show in their memory as growth that is not theirs."""
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    tuned = cpu_runtime_env(2, bind_threads=True, event_loop=True)
    untuned = untuned_env({**tuned, "INFERQ_REDIS_URL": "redis://x"})
    assert untuned["INFERQ_REDIS_URL"] == "redis://x"
    for key in ("MALLOC_CONF", "OMP_PROC_BIND", "GOMP_SPINCOUNT", "THP_MEM_ALLOC_ENABLE"):
        assert key not in untuned
    allocator = find_allocator()
    assert allocator is None or allocator not in untuned.get("LD_PRELOAD", "")


def test_a_worker_process_gets_a_short_openmp_spin(tmp_path: Path) -> None:
    # A worker's event loop needs the last core between engine steps; libgomp's default
    # spin-wait would keep its idle OpenMP thread there for milliseconds.
    seen = _run_probe_source(tmp_path, EVENT_LOOP_PROBE)
    assert seen == {"spin": EVENT_LOOP_SPIN_COUNT, "bind": "close"}


def test_a_worker_started_by_a_tuned_process_still_gets_its_spin(tmp_path: Path) -> None:
    # A benchmark tunes itself, then starts a worker with its environment: the worker must
    # not take the inherited marker for its own settings.
    inherited = {"INFERQ_CPU_RUNTIME_TUNED": "1", "OMP_PROC_BIND": "close"}
    assert (
        _run_probe_source(tmp_path, EVENT_LOOP_PROBE, **inherited)["spin"] == EVENT_LOOP_SPIN_COUNT
    )
    chosen = _run_probe_source(tmp_path, EVENT_LOOP_PROBE, **inherited, GOMP_SPINCOUNT="500")
    assert chosen["spin"] == "500"  # a value the user set is kept


def _affinity_after_move(cores: set[int]) -> tuple[bool, set[int]]:
    seen: list[tuple[bool, set[int]]] = []

    def in_a_thread() -> None:  # affinity is per thread: leave the test's own thread alone
        moved = move_to_last_core(cores)
        seen.append((moved, os.sched_getaffinity(0)))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    return seen[0]


def test_the_event_loop_moves_to_the_last_core_only_when_threads_are_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip("one core: nowhere to move")
    monkeypatch.delenv("OMP_PROC_BIND", raising=False)
    assert _affinity_after_move(cores) == (False, cores)
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    assert _affinity_after_move(cores) == (True, {max(cores)})
    assert _affinity_after_move({min(cores)}) == (False, cores)


def _niceness_after_lowering() -> tuple[bool, int]:
    seen: list[tuple[bool, int]] = []

    def in_a_thread() -> None:  # niceness is per thread on Linux: leave the test's own alone
        lowered = lower_event_loop_priority()
        seen.append((lowered, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_the_event_loop_yields_to_the_engine_threads_only_in_a_tuned_cpu_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tuned CPU worker's loop runs nicer than the engine's threads; the rest of the process
    (here, the test's own thread, standing for the engine's) keeps its priority."""
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    monkeypatch.delenv("INFERQ_CPU_RUNTIME_TUNED", raising=False)
    assert _niceness_after_lowering() == (False, own)
    monkeypatch.setenv("INFERQ_CPU_RUNTIME_TUNED", "1")
    assert _niceness_after_lowering() == (True, min(19, own + EVENT_LOOP_NICENESS))
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


def _anon_huge_kib() -> int:
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(rollup.split("AnonHugePages:")[1].split()[0])


def test_the_kv_cache_lands_on_huge_pages_once_used() -> None:
    # The cache is mapped lazily (a multi-GB cache costs nothing until used), outside torch's
    # allocator, so it must ask for huge pages itself; a decode step reads its blocks scattered
    # over the whole cache.
    if not _huge_pages_allowed() or not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("transparent huge pages are off on this machine")
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32
    )
    cache = KVCache(spec, num_blocks=num_blocks_for_budget(spec, 64 << 20), device="cpu")
    before = _anon_huge_kib()
    assert float(cache.tensor.abs().sum()) == 0.0  # zeroed, as attention's padding needs
    cache.tensor.fill_(1.0)
    assert _anon_huge_kib() - before >= 32 << 10  # most of its 64 MiB


def test_the_worker_start_up_leaves_torch_to_the_engine_thread() -> None:
    """A CPU worker reaches its re-exec and its event loop without loading torch: OpenMP,
    loaded with it, binds the thread that loads it to the first core, and an engine thread
    started from a bound event loop inherits that one core (its steps then run ~1.6x slower)."""
    probe = (
        "import sys\n"
        "import worker.main\n"
        "from engine.platforms.cpu.runtime import cpu_runtime_env, move_to_last_core\n"
        "print('torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == "False"
