"""Pick the fastest of several prefill-attention paths by timing each once.

The paths differ by device and library version (our Triton kernel at a few tile
configurations, torch's SDPA flash path), and which one wins is not knowable from their names:
each candidate is prepared on the step's typical shapes, run once to warm up (Triton compiles
then), timed once, and the fastest kept. A candidate that raises (a library without the
feature, a kernel the device cannot compile) drops out; where all drop out there is no choice
and the caller keeps its default. Device-agnostic: the CUDA candidates live in
engine.attention.cuda_prefill.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernels.paged_attention_tiles import PrefillTiles

logger = logging.getLogger(__name__)

Run = Callable[[], object]
# Seconds one call of a prepared run takes (after its warm-up call).
Timer = Callable[[Run], float]


@dataclass(frozen=True)
class PrefillCandidate:
    """name: how the choice is kept and logged; prepare: builds the candidate's inputs on the
    typical shapes and returns the call to time."""

    name: str
    prepare: Callable[[], Run]


@dataclass(frozen=True)
class PrefillChoice:
    """How steps with prefill chunks attend: SDPA per sequence, or the Triton kernel with
    `tiles` (None: its defaults)."""

    sdpa: bool = False
    tiles: PrefillTiles | None = None


def wall_timer(sync: Callable[[], None] = lambda: None) -> Timer:
    """Warm up once, then time one call; `sync` waits for the device (torch.cuda.synchronize)."""

    def timer(run: Run) -> float:
        run()
        sync()
        started = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - started

    return timer


def measure(candidates: Sequence[PrefillCandidate], timer: Timer) -> dict[str, float]:
    """Seconds per candidate that ran; those that raised are logged and left out."""
    seconds: dict[str, float] = {}
    for candidate in candidates:
        try:
            seconds[candidate.name] = timer(candidate.prepare())
        except Exception as exc:  # any failure only removes the candidate
            logger.warning("prefill attention candidate %s failed: %s", candidate.name, exc)
    return seconds


def fastest(seconds: dict[str, float]) -> str | None:
    """The name of the fastest measured candidate; None where none ran."""
    if not seconds:
        return None
    choice = min(seconds, key=seconds.__getitem__)
    logger.info(
        "prefill attention: %s (%s)",
        choice,
        ", ".join(f"{name} {1e3 * s:.3f} ms" for name, s in sorted(seconds.items())),
    )
    return choice
