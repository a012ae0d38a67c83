"""Measurements that hold for one machine, kept across starts under $INFERQ_HOME.

Start-up choices that are measured (the CPU matmul backends, whether compiled glue pays) depend
on the CPU model, its flags, the torch build, the thread count and the model's shapes, and on
nothing that changes between two starts of a worker. Each is stored as a JSON file named by a
hash of that key, so a second start reads it in a millisecond instead of measuring again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine.model_files import inferq_home
from kernels.cpu_ops import cpu_fields, cpu_flags

logger = logging.getLogger(__name__)

Stored = TypeVar("Stored")


def cpu_identity() -> tuple[str, str]:
    """(model name, hash of the flags); the platform's processor where /proc/cpuinfo is absent."""
    model = cpu_fields().get("model name") or platform.processor()
    return model, hashlib.sha256(cpu_flags().encode()).hexdigest()[:16]


def machine_key(**details: Any) -> dict[str, Any]:
    """What a measurement depends on: this CPU, torch and its threads, plus `details`."""
    model, flags = cpu_identity()
    return {
        "cpu": model,
        "cpu_flags": flags,
        "torch": torch.__version__,
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
    ValueError) on anything it does not recognise, which counts as absent."""
    path = _entry_path(kind, key)
    try:
        stored = json.loads(path.read_text())
        if stored["key"] == key:
            return read(stored["value"])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass  # absent or unreadable: measure again
    value = measure()
    store(kind, key, value)
    return value


def store(kind: str, key: dict[str, Any], value: Any) -> None:
    """Keep value as the measurement of key (what `cached` reads back); a failure is logged."""
    path = _entry_path(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{time.monotonic_ns()}.tmp")
        partial.write_text(json.dumps({"key": key, "value": value}, indent=1))
        partial.replace(path)  # atomic: engines starting together never read half a file
    except OSError as exc:
        logger.warning("could not keep the %s measurement in %s: %s", kind, path, exc)


def _entry_path(kind: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return inferq_home() / kind / f"{digest}.json"
