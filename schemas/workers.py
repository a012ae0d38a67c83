"""Worker heartbeat: what a live worker advertises in its hash `{p}:worker:{name}`."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from schemas.jobs import format_time
from schemas.results import as_utc


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
    started_at: AwareDatetime
    updated_at: AwareDatetime

    @field_validator("started_at", "updated_at")
    @classmethod
    def _in_utc(cls, value: datetime) -> datetime:
        return as_utc(value)

    def to_redis_hash(self) -> dict[str, str]:
        out = {}
        for name, value in self.model_dump().items():
            out[name] = format_time(value) if isinstance(value, datetime) else str(value)
        return out

    @classmethod
    def from_redis_hash(cls, data: Mapping[str | bytes, str | bytes]) -> WorkerInfo:
        return cls.model_validate(
            {
                (k.decode() if isinstance(k, bytes) else k): (
                    v.decode() if isinstance(v, bytes) else v
                )
                for k, v in data.items()
            }
        )
