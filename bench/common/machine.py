"""Name the machine a benchmark ran on: CPU model, cores, memory, torch, GPU."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The 'model name' line of /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# Read at import: once torch starts with OMP_PROC_BIND set (bench/common/workload.py's tuning), the
# main thread is pinned to a single core and would report 1.
_CORES_AT_IMPORT = _affinity()


def usable_cores() -> int:
    """Cores this process may run on (a container's cpuset, not the host's count)."""
    return _CORES_AT_IMPORT


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def describe_machine() -> dict[str, str]:
    """Labelled facts for the report header; the GPU only when torch sees CUDA."""
    import torch

    facts = {
        "CPU": cpu_model(),
        "cores": f"{usable_cores()} usable ({os.cpu_count()} online)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "OS": f"{platform.system()} {platform.release()}",
    }
    memory = memory_gib()
    if memory is not None:
        facts["memory"] = f"{memory:.0f} GiB"
    if torch.cuda.is_available():
        facts["GPU"] = torch.cuda.get_device_name(0)
    else:
        facts["device"] = "CPU only (no CUDA device)"
    return facts


def machine_one_liner(facts: dict[str, str]) -> str:
    """E.g. 'AMD EPYC, 2 cores, torch 2.13.0+cpu' for a table caption."""
    cores = facts["cores"].split()[0]
    device = facts.get("GPU", "CPU only")
    return f"{facts['CPU']}, {cores} cores, {device}, torch {facts['torch']}"
