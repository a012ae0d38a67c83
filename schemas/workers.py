"""What live workers advertise: the heartbeat hash, and the samples behind the live rates.

`WorkerInfo` is the hash `{p}:worker:{name}` (refreshed every heartbeat, TTL). The two sample
sorted sets below hold recent history per model, so an API (the dashboard) or `inferq status`
can compute tokens/s and TTFT percentiles over the last minutes from Redis alone, without
keeping state of its own: `{p}:ttft:{model}` (one member per finished job) and
`{p}:tokens:{model}` (one member per heartbeat of each worker: its cumulative token counts).
Both are scored by unix time, trimmed to `LIVE_STATS_WINDOW_S` and `LIVE_STATS_MAXLEN` by the
worker in its heartbeat pipeline, and expire when no worker writes them any more.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from schemas.jobs import format_time
from schemas.keys import decode_segment, encode_segment
from schemas.results import as_utc

LIVE_STATS_WINDOW_S = 15 * 60  # history kept in the sample sets
LIVE_STATS_MAXLEN = 50_000  # members kept at most per sample set (a busy model's TTFTs)


class WorkerInfo(BaseModel):
    """Heartbeat hash fields; all values are strings in Redis (ints decimal, times ISO UTC)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    model: str = Field(min_length=1)
    kv_blocks_free: int = Field(ge=0)
    kv_blocks_total: int = Field(ge=0)
    running: int = Field(0, ge=0)
    waiting: int = Field(0, ge=0)
    version: str = ""
    max_model_len: int | None = Field(None, ge=1, description="longest prompt + output it accepts")
    prompt_tokens: int = Field(0, ge=0, description="prompt tokens computed since it started")
    generated_tokens: int = Field(0, ge=0, description="tokens generated since it started")
    started_at: AwareDatetime
    updated_at: AwareDatetime

    @field_validator("started_at", "updated_at")
    @classmethod
    def _in_utc(cls, value: datetime) -> datetime:
        return as_utc(value)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0 when the worker has none)."""
        if not self.kv_blocks_total:
            return 0.0
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total

    def to_redis_hash(self) -> dict[str, str]:
        out = {}
        for name, value in self.model_dump(exclude_none=True).items():
            out[name] = format_time(value) if isinstance(value, datetime) else str(value)
        return out

    @classmethod
    def from_redis_hash(cls, data: Mapping[str, str] | Mapping[bytes, bytes]) -> WorkerInfo:
        return cls.model_validate(
            {
                (k.decode() if isinstance(k, bytes) else k): (
                    v.decode() if isinstance(v, bytes) else v
                )
                for k, v in data.items()
            }
        )


@dataclass(frozen=True)
class TtftSample:
    """One finished job's time to first token, in `{p}:ttft:{model}` (score: `finished_at`)."""

    finished_at: float  # unix seconds
    ttft_s: float
    job_id: str

    def member(self) -> str:
        # The job id keeps members unique: two jobs with the same TTFT are two samples.
        return f"{self.ttft_s:.6f}:{self.job_id}"

    @classmethod
    def parse(cls, member: str | bytes, score: float) -> TtftSample:
        text = member.decode() if isinstance(member, bytes) else member
        ttft, _, job_id = text.partition(":")
        return cls(float(score), float(ttft), job_id)


@dataclass(frozen=True)
class TokenSample:
    """A worker's cumulative token counts at one heartbeat, in `{p}:tokens:{model}`."""

    at: float  # unix seconds (the score)
    worker: str
    generated_tokens: int
    prompt_tokens: int

    def member(self) -> str:
        # The time is part of the member: equal counts at two beats are two samples.
        worker = encode_segment(self.worker)
        return f"{self.at:.3f}:{worker}:{self.generated_tokens}:{self.prompt_tokens}"

    @classmethod
    def parse(cls, member: str | bytes, score: float) -> TokenSample:
        text = member.decode() if isinstance(member, bytes) else member
        _at, worker, generated, prompt = text.split(":")
        return cls(float(score), decode_segment(worker), int(generated), int(prompt))
