"""Every knob of the API process in one pydantic settings class (environment prefix `INFERQ_`).

The worker reads the same prefix (`worker.settings`): `INFERQ_REDIS_URL` and `INFERQ_PREFIX`
mean the same thing to both, and no field here reuses a worker field name with another meaning.
"""

from __future__ import annotations

import logging

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from producer_api.auth import KeyTable, hash_api_key, is_key_hash
from schemas import DEFAULT_PREFIX
from schemas.defaults import PREFIX_HELP
from schemas.jobs import MAX_EMBEDDING_INPUTS
from schemas.redis_connection import RedisConnectionSettings
from schemas.sampling import MAX_N

log = logging.getLogger(__name__)

DEFAULT_PORT = 8000


class ApiSettings(RedisConnectionSettings, BaseSettings):
    """API configuration; each field can be set as `INFERQ_<FIELD>` in the environment
    (dicts and lists as JSON, e.g. `INFERQ_API_KEYS='{"alice": "sha256:..."}'`); where
    Redis is: `schemas.redis_connection.RedisConnectionSettings`."""

    model_config = SettingsConfigDict(env_prefix="INFERQ_", extra="ignore")

    prefix: str = Field(DEFAULT_PREFIX, description=PREFIX_HELP)
    host: str = Field("127.0.0.1", description="address the API listens on")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="port the API listens on")

    # auth: owner name -> "sha256:<hex of the key>" (a bare key is hashed when loaded, and only
    # the hash is kept). `python -m producer_api.auth KEY` prints the hash to paste here.
    api_keys: dict[str, str] = Field(default_factory=dict)
    auth_disabled: bool = Field(
        False, description="accept requests without a key (local use only; jobs are anonymous)"
    )

    # models: a model is served when a live worker advertises it; `models` are accepted on
    # the jobs API even while no worker runs (the jobs wait in the queue)
    models: list[str] = Field(default_factory=list)
    allow_runtime_lora_updating: bool = Field(
        False,
        description="accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): any key holder may then change the adapters served",
    )
    lora_update_timeout_s: float = Field(
        10.0,
        gt=0,
        description="how long a LoRA load/unload waits for the base model's workers to say so",
    )
    model_context: dict[str, int] = Field(
        default_factory=dict,
        description="context length per model when workers don't advertise max_model_len",
    )

    # backpressure and limits
    max_queue_len: int = Field(1000, ge=1, description="per-model backlog before 429")
    queue_limits: dict[str, int] = Field(default_factory=dict, description="per-model override")
    retry_after_s: int = Field(2, ge=1)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_n: int = Field(8, ge=1, le=MAX_N)
    max_prompts: int = Field(32, ge=1, description="prompts in one /v1/completions call")
    max_embedding_inputs: int = Field(
        2048, ge=1, le=MAX_EMBEDDING_INPUTS, description="inputs in one /v1/embeddings call"
    )
    default_max_tokens: int = Field(
        1024, ge=1, description="chat max_tokens when neither the request nor a context caps it"
    )

    # bulk work (Files and Batch API): files live in Redis memory, so they are capped
    max_file_bytes: int = Field(100 * 1024 * 1024, ge=1024, description="largest batch file")
    max_batch_lines: int = Field(50_000, ge=1, description="requests in one batch input file")
    file_retention_s: int = Field(7 * 24 * 3600, ge=60, description="lifetime of uploaded files")

    # waiting and streaming
    request_timeout_s: float = Field(
        600.0, gt=0, description="deadline of jobs made by the OpenAI endpoints"
    )
    max_wait_s: float = Field(300.0, gt=0, description="cap of GET /v1/jobs/{id}/wait?timeout=")
    poll_interval_s: float = Field(1.0, gt=0)
    sse_keepalive_s: float = Field(15.0, gt=0)
    worker_cache_s: float = Field(1.0, ge=0, description="how long the live-worker list is reused")

    @field_validator("api_keys")
    @classmethod
    def _hash_bare_keys(cls, value: dict[str, str]) -> dict[str, str]:
        hashed = {}
        for owner, key in value.items():
            if not owner or len(owner) > 256:
                raise ValueError("api_keys: owner names must be 1-256 characters")
            if not key:
                raise ValueError(f"api_keys: the key of {owner!r} is empty")
            hashed[owner] = key if is_key_hash(key) else hash_api_key(key)
        return hashed

    @model_validator(mode="after")
    def _some_auth(self) -> ApiSettings:
        if not self.api_keys and not self.auth_disabled:
            raise ValueError(
                "no API keys configured: set INFERQ_API_KEYS (owner -> key hash), or "
                "INFERQ_AUTH_DISABLED=1 for local use without authentication"
            )
        return self

    def key_table(self) -> KeyTable:
        return KeyTable.from_hashes(self.api_keys)

    def queue_limit(self, model: str) -> int:
        return self.queue_limits.get(model, self.max_queue_len)
