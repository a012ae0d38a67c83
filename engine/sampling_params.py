"""The engine's SamplingParams: the wire contract's, plus how an in-process stream reports.

`output_kind` is vLLM's: it only shapes what `AsyncLLM.generate` yields in this process, so it
stays out of `schemas` (a queued job always streams numbered deltas and stores one result).
"""

from __future__ import annotations

from enum import Enum

from schemas.sampling import SamplingParams as WireSamplingParams


class RequestOutputKind(Enum):
    """What each output of a stream holds, as vLLM names it."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes, then the whole output


class SamplingParams(WireSamplingParams):
    """SamplingParams as vLLM's Python API takes them (`output_kind` for streams)."""

    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


def output_kind_of(params: WireSamplingParams) -> RequestOutputKind:
    """A stream's output kind: the wire type has none, and streams cumulatively as vLLM does."""
    if isinstance(params, SamplingParams):
        return params.output_kind
    return RequestOutputKind.CUMULATIVE
