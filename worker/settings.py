"""Every knob of a worker in one pydantic settings class (environment prefix `INFERQ_`).

The engine's arguments are not repeated here: `WorkerSettings` inherits one optional setting
per `engine.config.EngineConfig` field (see worker.engine_settings).
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from pydantic import Field, model_validator

from engine.config import EngineConfig
from schemas import DEFAULT_PREFIX
from schemas.defaults import DEFAULT_MODEL, PREFIX_HELP
from schemas.keys import (
    DEFAULT_CLAIM_MIN_IDLE_MS,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_CRASH_RESUMES,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TTL_S,
)
from schemas.redis_connection import RedisConnectionSettings
from worker.engine_settings import EngineSettings, engine_config_of, engine_setting
from worker.lora import parse_lora_modules


def default_worker_name() -> str:
    """Unique per process: two workers on one host never share a consumer name by accident."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class WorkerSettings(RedisConnectionSettings, EngineSettings):
    """Worker configuration; each field can be set as `INFERQ_<FIELD>` in the environment."""

    # what to serve, and where
    model: str = engine_setting("model", DEFAULT_MODEL)
    served_model_name: str | None = Field(
        None, description="queue name to serve (default: `model`); jobs name this model"
    )
    prefix: str = Field(DEFAULT_PREFIX, description=PREFIX_HELP)
    name: str = Field(default_factory=default_worker_name, min_length=1)
    lora_modules: list[str] = Field(
        default_factory=list,
        description="LoRA adapters served from the start, as vLLM's --lora-modules: a JSON list "
        "of 'name=path' (PEFT folders); a request whose model is a name runs on this model with "
        "that adapter (needs enable_lora)",
    )
    lora_affinity_wait_s: float = Field(
        1.0,
        ge=0,
        description="a job for a LoRA adapter this worker does not hold resident waits at most "
        "this long for a live worker of the model that does and has room, then runs here "
        "(0: run here at once); see worker/lora_affinity.py",
    )

    # how the engine is made (its arguments: the engine settings, inherited)
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
    max_attempts: int = Field(
        DEFAULT_MAX_ATTEMPTS,
        ge=1,
        description="starts held against a job before it is dead-lettered: starts cut off by "
        "a worker's death during their first engine step, as its only newcomer "
        "(see worker/crashes.py)",
    )
    max_crash_resumes: int = Field(
        DEFAULT_MAX_CRASH_RESUMES,
        ge=0,
        description="starts cut off by a worker's death not held against the job (outside its "
        "first step, or a first step shared with other newcomers) before it is dead-lettered "
        "all the same",
    )
    claim_min_idle_ms: int = Field(DEFAULT_CLAIM_MIN_IDLE_MS, ge=10)
    janitor_interval_s: float | None = Field(
        None, gt=0, description="how often to look for dead workers' jobs (default min_idle/3)"
    )
    status_check_interval_s: float = Field(2.0, gt=0)

    # publishing: a choice's chunk goes out once it holds chunk_tokens tokens or its oldest
    # token waited chunk_interval_ms (1 and 0: every step); see worker.chunking.ChunkPolicy
    chunk_tokens: int = Field(
        16, ge=1, description="a streaming chunk closes at this many tokens (1: every step)"
    )
    chunk_interval_ms: float = Field(
        10.0,
        ge=0,
        description="... or once its oldest token waited this long (counted from the start of "
        "the step that made it: steps longer than this publish every step)",
    )
    chunk_unwatched_ms: float = Field(
        500.0,
        ge=0,
        description="a streaming job nobody subscribes to writes its replay stream this often "
        "instead (0: as if watched); a subscriber is noticed within a round, or "
        "within chunk_interval_ms when the worker has nothing else to write",
    )

    # lifecycle
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM / SIGINT, how long running jobs may finish before the rest are "
        "handed back to the queue (a second signal: at once)",
    )
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
        parse_lora_modules(self.lora_modules)  # a bad entry fails at start-up, named
        if self.lora_modules and not self.lora_enabled:
            raise ValueError("lora_modules needs enable_lora")
        return self

    @property
    def lora_enabled(self) -> bool:
        """Whether its engine serves LoRA adapters (the engine setting enable_lora)."""
        return bool(self.model_dump(include={"enable_lora"}).get("enable_lora"))

    def engine_config(self) -> EngineConfig:
        """The engine this worker runs: its model, with the engine settings given."""
        return engine_config_of(self, self.model)

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
