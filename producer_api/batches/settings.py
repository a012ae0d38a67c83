"""Settings of the batch controller process (arq worker), environment prefix `INFERQ_`.

The API process keeps its own `ApiSettings` (upload limits live there); the names shared with
it (`redis_url`, `prefix`, `default_max_tokens`) mean the same in both."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import DEFAULT_PREFIX
from schemas.defaults import PREFIX_HELP
from schemas.redis_connection import RedisConnectionSettings


class BatchControllerSettings(RedisConnectionSettings, BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INFERQ_", extra="ignore")

    prefix: str = Field(DEFAULT_PREFIX, description=PREFIX_HELP)
    default_max_tokens: int = Field(
        1024, ge=1, description="chat max_tokens when a batch line gives none"
    )
    batch_chunk_lines: int = Field(200, ge=1, description="lines enqueued per fan-out round")
    batch_embedding_group_lines: int = Field(
        64,
        ge=1,
        le=64,
        description="consecutive `/v1/embeddings` lines of one model run as one job of this "
        "many inputs (1: a job per line); a batch keeps the size it started with. At most 64, "
        "so the line numbers a job names always fit its metadata",
    )
    batch_max_backlog: int = Field(
        2000,
        ge=1,
        description="fan-out pauses while the model's bulk stream holds this many entries "
        "(jobs: a group of embedding lines is one)",
    )
    batch_max_in_flight: int = Field(
        5000, ge=1, description="most unfinished jobs of one batch at any time"
    )
    batch_poll_interval_s: float = Field(
        0.5,
        gt=0,
        description="how often lines fan out and the jobs workers announced ended are collected",
    )
    batch_sweep_interval_s: float = Field(
        10.0,
        gt=0,
        description="how often every unfinished job's status is read, for the ends no worker "
        "announced (a cancel, an expiry, a worker that died right after a result)",
    )
    batch_status_reads_per_s: float = Field(
        1000.0,
        gt=0,
        description="job statuses one batch's sweep reads per second at most: with thousands of "
        "its jobs in flight, sweeps come less often than every sweep interval, so the reads stay "
        "a small share of Redis's and the controller's CPU",
    )
    batch_lease_s: float = Field(
        15.0, gt=0, description="a controller run's hold on a batch; a dead run's ends this late"
    )
    batch_tick_s: float = Field(
        60.0, gt=0, description="one arq job advances a batch this long, then queues the next"
    )
    batch_resume_every_s: int = Field(
        5, ge=1, le=60, description="how often batches whose controller died are resumed"
    )
    batch_retention_s: int = Field(
        7 * 24 * 3600, ge=60, description="how long finished batches and their files are kept"
    )
