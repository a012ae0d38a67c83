"""Structured log lines: `event key=value ...` text plus the same fields as record extras."""

from __future__ import annotations

import logging
from typing import Any


def _format_value(value: Any) -> str:
    text = str(value)
    return f'"{text}"' if (" " in text or not text) else text


def log_event(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    """Log `event k=v ...`; handlers that emit JSON find `event` and `fields` on the record."""
    if not logger.isEnabledFor(level):
        return
    pairs = " ".join(f"{key}={_format_value(value)}" for key, value in fields.items())
    logger.log(
        level, f"{event} {pairs}" if pairs else event, extra={"event": event, "fields": fields}
    )
