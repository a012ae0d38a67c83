"""Measurements that hold for one machine, kept across starts under $INFERQ_HOME.

Start-up choices that are measured (the CPU matmul backends, whether compiled glue pays) depend
on the CPU model, its flags, the torch build, the thread count and the model's shapes, and on
nothing that changes between two starts of a worker. Each is stored as a JSON file named by a
hash of that key, so a second start reads it in a millisecond instead of measuring again (one
taken on a busy machine is provisional, see `cached`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine.model_files import inferq_home
from kernels import cpu_ops
from kernels.cpu_build import cpu_fields, cpu_flags

logger = logging.getLogger(__name__)

# Other processes' share of all cores above which a measurement is not stored.
BUSY_SHARE_LIMIT = 0.15
# How long a start watches the CPU before re-measuring a provisional measurement.
BUSY_PROBE_S = 0.3
PROBE_VALID_S = 60.0

Stored = TypeVar("Stored")


def cpu_identity() -> tuple[str, str]:
    """(model name, hash of the flags); the platform's processor where /proc/cpuinfo is absent."""
    model = cpu_fields().get("model name") or platform.processor()
    return model, hashlib.sha256(cpu_flags().encode()).hexdigest()[:16]


def machine_key(**details: Any) -> dict[str, Any]:
    """What a measurement depends on: this CPU, torch and its threads, our CPU kernels' build
    (a changed kernel is measured again), plus `details`."""
    model, flags = cpu_identity()
    return {
        "cpu": model,
        "cpu_flags": flags,
        "torch": torch.__version__,
        "kernels": cpu_ops.build_name(),
        "threads": torch.get_num_threads(),
        **details,
    }


def cached(
    kind: str,
    key: dict[str, Any],
    measure: Callable[[], Stored],
    read: Callable[[Any], Stored],
) -> Stored:
    """The stored result of `measure` for key, else measure now and store it.

    `read` turns the stored JSON back into the result and raises (KeyError, TypeError,
    ValueError) on anything it does not recognise, which counts as absent. A measurement
    taken while other processes kept the CPU busy is kept as provisional: load from elsewhere
    slows the candidates unevenly, so the first start that finds the machine quiet measures
    again and keeps that for good, while starts on a machine still busy reuse it rather than
    measuring for tens of seconds each (a restarted worker must serve within seconds)."""
    try:
        value, provisional = _read_entry(kind, key, read)
    except LookupError:
        pass
    else:
        if not provisional or _busy_now():
            return value
    before, started = _cpu_ticks(), time.monotonic()
    value = measure()
    share = _others_share(before, _cpu_ticks(), time.monotonic() - started)
    busy = share > BUSY_SHARE_LIMIT
    if busy:
        logger.info(
            "%s measurement kept as provisional: other processes used %.0f%% of the CPU"
            " meanwhile (a start on a quiet machine measures again)",
            kind,
            100 * share,
        )
    _store(kind, key, value, provisional=busy)
    return value


def lookup(kind: str, key: dict[str, Any], read: Callable[[Any], Stored]) -> Stored | None:
    """The stored measurement of key, read back by `read` (see `cached`), provisional or
    not; None if absent."""
    try:
        return _read_entry(kind, key, read)[0]
    except LookupError:
        return None


def _read_entry(
    kind: str, key: dict[str, Any], read: Callable[[Any], Stored]
) -> tuple[Stored, bool]:
    """(the stored measurement of key, which may itself be None; whether it is provisional);
    LookupError if absent."""
    try:
        stored = json.loads(_entry_path(kind, key).read_text())
        if stored["key"] == key:
            return read(stored["value"]), bool(stored.get("provisional", False))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass  # absent or unreadable
    raise LookupError(kind)


_last_probe: list[tuple[float, bool]] = []  # (monotonic time, busy): one probe serves a start


def _busy_now() -> bool:
    """Whether other processes use more than BUSY_SHARE_LIMIT of the CPU right now (watched
    for BUSY_PROBE_S; the answer holds for the rest of a start, PROBE_VALID_S)."""
    if _last_probe and time.monotonic() - _last_probe[-1][0] < PROBE_VALID_S:
        return _last_probe[-1][1]
    before, started = _cpu_ticks(), time.monotonic()
    time.sleep(BUSY_PROBE_S)
    busy = _others_share(before, _cpu_ticks(), time.monotonic() - started) > BUSY_SHARE_LIMIT
    _last_probe[:] = [(time.monotonic(), busy)]
    return busy


def _store(kind: str, key: dict[str, Any], value: Any, *, provisional: bool) -> None:
    path = _entry_path(kind, key)
    entry = {"key": key, "value": value, "provisional": provisional}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{time.monotonic_ns()}.tmp")
        partial.write_text(json.dumps(entry, indent=1))
        partial.replace(path)  # atomic: engines starting together never read half a file
    except OSError as exc:
        logger.warning("could not keep the %s measurement in %s: %s", kind, path, exc)


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy clock ticks of every core, ticks of this process) from /proc; None off Linux."""
    try:
        machine = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return None
    idle = machine[3] + machine[4]  # idle, iowait; steal counts as busy: others had the core
    return sum(machine) - idle, int(own[11]) + int(own[12])  # this process's utime + stime


def _others_share(
    before: tuple[int, int] | None, after: tuple[int, int] | None, seconds: float
) -> float:
    """The share of all cores that other processes used over `seconds` between two
    `_cpu_ticks`; 0 where unknown or too short to tell apart from tick rounding."""
    if before is None or after is None or seconds < 0.2:
        return 0.0
    capacity = seconds * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / capacity)


def _entry_path(kind: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return inferq_home() / kind / f"{digest}.json"
