"""Every knob of a worker in one pydantic settings class (environment prefix `INFERQ_`)."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import DEFAULT_PREFIX
from schemas.keys import (
    DEFAULT_CLAIM_MIN_IDLE_MS,
    DEFAULT_MAX_ATTEMPTS,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TTL_S,
)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # engine.model_files.DEFAULT_MODEL, without importing it


def default_worker_name() -> str:
    """Unique per process: two workers on one host never share a consumer name by accident."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class WorkerSettings(BaseSettings):
    """Worker configuration; each field can be set as `INFERQ_<FIELD>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="INFERQ_", extra="ignore")

    # what to serve, and where
    model: str = DEFAULT_MODEL
    served_model_name: str | None = Field(
        None, description="queue name to serve (default: `model`); jobs name this model"
    )
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = DEFAULT_PREFIX
    name: str = Field(default_factory=default_worker_name, min_length=1)

    # engine (None: the engine's own default)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int | None = Field(None, ge=1)
    engine_factory: str | None = Field(
        None, description="'module:function' taking these settings and returning an engine"
    )

    # pulling work
    max_pull: int = Field(64, ge=1, description="most entries taken in one read")
    block_ms: int = Field(500, ge=1, description="XREADGROUP BLOCK while the engine is idle")
    admission_prompt_tokens: int = Field(
        128, ge=1, description="assumed prompt length until real jobs have been seen"
    )
    bulk_max_held: int | None = Field(
        None,
        ge=1,
        description="most bulk-stream jobs held at once (None: KV admission only); leaves "
        "sequence slots to interactive jobs",
    )
    max_attempts: int = Field(DEFAULT_MAX_ATTEMPTS, ge=1)
    claim_min_idle_ms: int = Field(DEFAULT_CLAIM_MIN_IDLE_MS, ge=10)
    janitor_interval_s: float | None = Field(
        None, gt=0, description="how often to look for dead workers' jobs (default min_idle/3)"
    )
    status_check_interval_s: float = Field(2.0, gt=0)

    # publishing: a choice's chunk goes out once it holds chunk_tokens tokens or its oldest
    # token waited chunk_interval_ms (1 and 0: every step)
    chunk_tokens: int = Field(1, ge=1)
    chunk_interval_ms: float = Field(0.0, ge=0)

    # lifecycle
    drain_timeout_s: float = Field(30.0, ge=0)
    heartbeat_interval_s: float = Field(HEARTBEAT_INTERVAL_S, gt=0)
    heartbeat_ttl_s: int = Field(HEARTBEAT_TTL_S, ge=1)
    reconnect_min_s: float = Field(0.05, gt=0)
    reconnect_max_s: float = Field(5.0, gt=0)
    socket_timeout_s: float = Field(10.0, gt=0)

    # observability
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_host: str = "0.0.0.0"
    chunk_trace_path: Path | None = Field(
        None, description="append 'job_id index emit_unix_time' per chunk (benchmarks)"
    )

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s must be at least reconnect_min_s")
        return self

    @property
    def queue_model(self) -> str:
        """The model name jobs carry, i.e. which jobs stream this worker reads."""
        return self.served_model_name or self.model

    @property
    def lease_interval_s(self) -> float:
        return self.claim_min_idle_ms / 3000.0

    @property
    def janitor_every_s(self) -> float:
        return self.janitor_interval_s or self.claim_min_idle_ms / 3000.0
