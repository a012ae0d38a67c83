"""Exponential backoff with jitter for reconnecting to Redis without hammering it."""

from __future__ import annotations

import random
import time


class Backoff:
    """Tracks failures of one kind of Redis work and says when to try again.

    `ready()` never sleeps, so the engine loop keeps stepping while Redis is away; idle code
    awaits `delay()` instead."""

    def __init__(self, minimum_s: float, maximum_s: float) -> None:
        self.minimum_s = minimum_s
        self.maximum_s = maximum_s
        self.failures = 0
        self._retry_at = 0.0

    def failed(self) -> float:
        """Record a failure; returns the seconds until the next attempt."""
        self.failures += 1
        base = min(self.maximum_s, self.minimum_s * 2.0 ** (self.failures - 1))
        wait = base * random.uniform(0.5, 1.0)
        self._retry_at = time.monotonic() + wait
        return wait

    def succeeded(self) -> bool:
        """Record a success; returns True when this ends a run of failures (a reconnect)."""
        recovered = self.failures > 0
        self.failures = 0
        self._retry_at = 0.0
        return recovered

    def ready(self) -> bool:
        return time.monotonic() >= self._retry_at

    def delay(self) -> float:
        return max(0.0, self._retry_at - time.monotonic())
