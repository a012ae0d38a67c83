"""Optional per-chunk trace (`job_id index emit_unix_time` lines) for latency benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO


class ChunkTracer:
    """Records when each chunk left the engine; a no-op without a path."""

    def __init__(self, path: Path | None) -> None:
        self._file: TextIO | None = path.open("a", buffering=1 << 16) if path else None

    def emit(self, job_id: str, index: int, emitted_at: float) -> None:
        if self._file is not None:
            self._file.write(f"{job_id} {index} {emitted_at:.6f}\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
