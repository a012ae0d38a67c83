"""What live workers advertise: the heartbeat hash, and the samples behind the live rates.

`WorkerInfo` is the hash `{p}:worker:{name}` (refreshed every heartbeat, TTL). The two sample
sorted sets below hold recent history per model, so an API (the dashboard) or `inferq status`
can compute tokens/s and TTFT percentiles over the last minutes from Redis alone, without
keeping state of its own, and the API's /metrics can feed its latency histograms:
`{p}:ttft:{model}` (one member per succeeded job: its TTFT and other latencies) and
`{p}:tokens:{model}` (one member per heartbeat of each worker: its cumulative token counts).
Both are scored by unix time, trimmed to `LIVE_STATS_WINDOW_S` and `LIVE_STATS_MAXLEN` by the
worker in its heartbeat pipeline, and expire when no worker writes them any more.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from schemas.jobs import JobKind, PriorityClass, as_text, decode_hash, format_time
from schemas.keys import decode_segment, encode_segment
from schemas.results import JobResult, as_utc

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
    vocab_size: int | None = Field(None, ge=1, description="prompt token ids must be below it")
    tokenizer_file: str | None = Field(
        None,
        min_length=1,
        description="absolute path of the model's tokenizer.json on the worker's host: an API "
        "that can read it there counts prompt tokens before queueing",
    )
    quantization: str | None = Field(
        None,
        min_length=1,
        description="the weight quantization its engine runs (int8, int4, gguf, gptq, awq, fp8); "
        "None: full precision, or a worker too old to say",
    )
    weight_bytes: int | None = Field(
        None, ge=0, description="bytes its model's weights take in memory, as loaded"
    )
    architecture: str | None = Field(
        None,
        min_length=1,
        description="the model architecture its engine serves the model as (transformers' "
        "name, e.g. Qwen3ForCausalLM); None: a worker too old to say, or an engine that does "
        "not know",
    )
    task: JobKind = Field(
        JobKind.GENERATION, description="the kind of job its model serves; it takes no other"
    )
    embedding_size: int | None = Field(
        None, ge=1, description="an embedding worker's vector size: `dimensions` may not exceed it"
    )
    lora_adapters: list[str] = Field(
        default_factory=list,
        description="the LoRA adapters it serves on its model, by name (a request whose model "
        "names one runs on this worker's model with it); a JSON list in the hash",
    )
    lora_resident: list[str] = Field(
        default_factory=list,
        description="of lora_adapters, those in its engine's slots now (max_loras): a job for "
        "one runs at its next step without loading anything; empty from a worker too old to say",
    )
    lora_cached: list[str] = Field(
        default_factory=list,
        description="of lora_adapters, those in its host memory but in no slot (max_cpu_loras): "
        "a step copies one in without reading its folder",
    )
    prompt_tokens: int = Field(0, ge=0, description="prompt tokens computed since it started")
    generated_tokens: int = Field(0, ge=0, description="tokens generated since it started")
    started_at: AwareDatetime
    updated_at: AwareDatetime

    @field_validator("started_at", "updated_at")
    @classmethod
    def _in_utc(cls, value: datetime) -> datetime:
        return as_utc(value)

    @field_validator("lora_adapters", "lora_resident", "lora_cached", mode="before")
    @classmethod
    def _json_list(cls, value: object) -> object:
        return json.loads(value) if isinstance(value, str) else value

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0 when the worker has none)."""
        if not self.kv_blocks_total:
            return 0.0
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total

    def has_room(self) -> bool:
        """Whether it would start another job now: nothing waiting, KV blocks free."""
        return self.waiting == 0 and self.kv_blocks_free > 0

    def to_redis_hash(self) -> dict[str, str]:
        out = {}
        for name, value in self.model_dump(exclude_none=True).items():
            if isinstance(value, list):
                out[name] = json.dumps(value)
            else:
                out[name] = format_time(value) if isinstance(value, datetime) else str(value)
        return out

    @classmethod
    def from_redis_hash(cls, data: Mapping[str, str] | Mapping[bytes, bytes]) -> WorkerInfo:
        """Parse a heartbeat hash; fields a newer worker adds beyond these are ignored."""
        fields = decode_hash(data)
        return cls.model_validate({k: v for k, v in fields.items() if k in cls.model_fields})


@dataclass(frozen=True)
class TtftSample:
    """One succeeded job's latencies, in `{p}:ttft:{model}` (score: `finished_at`): its time to
    first token, and (members written since they were added) its priority class, end-to-end
    latency and mean inter-token latency over its `output_tokens`."""

    finished_at: float  # unix seconds
    ttft_s: float
    job_id: str
    priority: PriorityClass = PriorityClass.INTERACTIVE
    e2e_s: float | None = None  # queued -> finished
    itl_s: float | None = None  # mean time between two output tokens of its longest choice
    output_tokens: int = 0  # tokens of its longest choice (itl_s spans output_tokens - 1 gaps)

    @classmethod
    def of_result(
        cls, job_id: str, priority: int, result: JobResult, finished_at: float | None = None
    ) -> TtftSample | None:
        """The sample of a succeeded job's result; None when it has no first token time."""
        timings = result.timings
        if timings.ttft_s is None:
            return None
        tokens = max(len(choice.token_ids) for choice in result.choices)
        itl = None
        if timings.decode_s is not None and tokens > 1:
            itl = timings.decode_s / (tokens - 1)
        if finished_at is None:
            done = timings.finished_at
            finished_at = done.timestamp() if done is not None else time.time()
        return cls(
            finished_at,
            timings.ttft_s,
            job_id,
            PriorityClass.of(priority),
            timings.total_s,
            itl,
            tokens,
        )

    def member(self) -> str:
        # The job id keeps members unique: two jobs with the same TTFT are two samples. It comes
        # second, as in the first member format (`ttft:job`), which `parse` still reads.
        return ":".join(
            (
                f"{self.ttft_s:.6f}",
                self.job_id,
                self.priority.value,
                _optional(self.e2e_s),
                _optional(self.itl_s),
                str(self.output_tokens),
            )
        )

    @classmethod
    def parse(cls, member: str | bytes, score: float) -> TtftSample:
        parts = as_text(member).split(":")
        if len(parts) == 2:
            return cls(float(score), float(parts[0]), parts[1])
        ttft, job_id, priority, e2e, itl, tokens = parts
        return cls(
            float(score),
            float(ttft),
            job_id,
            PriorityClass(priority),
            float(e2e) if e2e else None,
            float(itl) if itl else None,
            int(tokens),
        )


def _optional(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


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
        _at, worker, generated, prompt = as_text(member).split(":")
        return cls(float(score), decode_segment(worker), int(generated), int(prompt))
