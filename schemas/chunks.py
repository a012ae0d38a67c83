"""Token chunks: the numbered pieces of output a worker publishes after every engine step.

Wire format (followed exactly by the worker, the API and the clients)
=====================================================================

One chunk = the new output of ONE choice of ONE job in one engine step. Chunks of a job are
numbered by `index` 0, 1, 2, ... across all its choices, contiguous, each number used once.
A job with `sampling.n = 2` therefore publishes two chunks per step (one per choice that made
progress), e.g. index 6 for choice 0 and index 7 for choice 1.

JSON (compact, `TokenChunk.to_json()`; fields at their default value are left out, so a reader
must treat a missing field as its default)::

    {"job_id":"job_x","index":3,"choice":1,"text":" world","token_ids":[1917],
     "logprobs":[{"token_id":1917,"logprob":-0.12,"token":" world",
                  "top_logprobs":[{"token_id":1917,"logprob":-0.12,"token":" world"}]}],
     "finish_reason":"stop","stop_reason":"\\n","final":true}

    field          default  meaning
    job_id         (req.)   the job id
    index          (req.)   chunk number within the job, from 0
    choice         0        which of the n choices this delta belongs to
    text           ""       the text delta (may be "" e.g. while a multi-byte char is incomplete,
                            or on a chunk that only carries a finish_reason)
    token_ids      []       the token ids generated in this step for this choice
    logprobs       absent   only when sampling.logprobs: one entry per token id, same order
    finish_reason  absent   set on the LAST chunk of a choice: stop | length | abort | error
    stop_reason    absent   the stop string (str) or stop token id (int) that ended the choice
    final          false    true on the last chunk of the whole job (all choices finished);
                            a final chunk always has a finish_reason

Invariants: for each choice, concatenating `text` of its chunks in index order gives the choice's
result text, and concatenating `token_ids` gives its output token ids. A worker that re-runs a job
(after another worker died) continues numbering after the last published index and never
republishes an index.

Where chunks go (in this order, in the one pipeline a worker sends per engine step):

1. `XADD {p}:out:{job_id} MAXLEN ~ OUT_STREAM_MAXLEN <chunk_stream_id(index)> c <chunk JSON>`
   The replay stream uses explicit entry ids `0-<index+1>` (see `chunk_stream_id`): Redis then
   refuses (error "equal or smaller") a second chunk with the same or an older index, so a
   duplicate run can never put a token twice into the replay stream, and a reader resumes after
   chunk k with `XRANGE key <replay_start_after(k)> +`. `EXPIRE` the stream OUT_STREAM_TTL_S.
2. `PUBLISH {p}:chan:{job_id} <the same chunk JSON>` for live listeners, only while the job's
   channel has a subscriber (or any pattern subscription exists): the worker asks Redis
   (`PUBSUB NUMSUB` / `NUMPAT`) after the XADDs of each pipeline, and publishes in the next
   pipeline the chunks a subscriber that just joined may have missed.

XADD before PUBLISH matters: a listener that sees chunk k live can fetch every chunk < k from
the replay stream. A listener MUST subscribe first and replay after (then dedupe by index):
every chunk XADDed before its replay is in the replay, and every later one reaches it live
(perhaps one worker round late, perhaps twice). A streaming job coalesces by tokens and time
(the worker's `chunk_tokens`, `chunk_interval_ms`), and while nobody subscribes by
`chunk_unwatched_ms`. For a job with `stream=false` a worker may coalesce: publish nothing until
the end, then one chunk per choice carrying the choice's whole output (the last one final).

The job channel also carries `StatusEvent` messages (see `schemas.events`); tell the two apart
with `schemas.events.parse_channel_message`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FinishReason = Literal["stop", "length", "abort", "error"]
"""stop: EOS / stop string / stop token; length: max_tokens or context; abort: cancelled or
deadline; error: the engine failed on this job."""

TokenId = Annotated[int, Field(strict=True, ge=0)]
StopReason = str | Annotated[int, Field(strict=True, ge=0)] | None

LOGPROB_FLOOR = -9999.0
"""-inf logprobs (JSON has no infinity) are stored as this value, as OpenAI does."""

REPLAY_FIELD = "c"
"""The one field of a replay stream entry: the chunk JSON."""


@dataclass(frozen=True)
class ChunkWrite:
    """One chunk as a worker writes it: XADD to `out_stream` at `entry_id`, PUBLISH on
    `channel` (see `worker.chunk_relay`)."""

    job_id: str
    index: int
    out_stream: str
    channel: str
    entry_id: str
    payload: str
    set_ttl: bool


def _finite_logprob(value: object) -> object:
    if isinstance(value, float) and math.isinf(value) and value < 0:
        return LOGPROB_FLOOR
    return value


class Logprob(BaseModel):
    """One candidate token and its log-probability."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    token_id: TokenId
    logprob: float
    token: str | None = Field(None, description="the token's text, when the worker decodes it")

    @field_validator("logprob", mode="before")
    @classmethod
    def _floor_minus_inf(cls, value: object) -> object:
        return _finite_logprob(value)


class TokenLogprob(Logprob):
    """A generated token's log-probability plus the most likely alternatives at that position."""

    top_logprobs: list[Logprob] = Field(default_factory=list)


class TokenChunk(BaseModel):
    """New output of one choice of one job in one engine step (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(min_length=1)
    index: int = Field(ge=0, strict=True, description="chunk number within the job, from 0")
    choice: int = Field(0, ge=0, strict=True)
    text: str = ""
    token_ids: list[TokenId] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None
    final: bool = False
    # The prompt's length in tokens, on the first chunk a worker publishes for the job (so a
    # stream can report running usage without a tokenizer of its own).
    prompt_tokens: int | None = Field(None, ge=0, strict=True)

    @model_validator(mode="after")
    def _consistent(self) -> TokenChunk:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError("logprobs must have one entry per token in token_ids")
        if self.final and self.finish_reason is None:
            raise ValueError("a final chunk must carry a finish_reason")
        if self.stop_reason is not None and self.finish_reason is None:
            raise ValueError("stop_reason requires a finish_reason")
        return self

    def to_json(self) -> str:
        """The compact wire form: fields at their defaults are left out."""
        return self.model_dump_json(exclude_defaults=True)

    @classmethod
    def from_json(cls, data: str | bytes) -> TokenChunk:
        return cls.model_validate_json(data)


def chunk_stream_id(index: int) -> str:
    """The explicit replay-stream entry id of chunk `index` (`0-<index+1>`; `0-0` is not allowed)."""
    if index < 0:
        raise ValueError("chunk index must be non-negative")
    return f"0-{index + 1}"


def chunk_index_from_stream_id(entry_id: str | bytes) -> int:
    """Inverse of `chunk_stream_id`."""
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    return int(entry_id.partition("-")[2]) - 1


def replay_start_after(last_index: int) -> str:
    """XRANGE start that returns the chunks after `last_index` (-1: from the first chunk)."""
    return chunk_stream_id(max(last_index + 1, 0))
