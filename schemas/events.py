"""Non-chunk messages: job status events on a job's channel, and control broadcasts to workers.

Job channel `{p}:chan:{id}` carries two kinds of JSON message:

- a `TokenChunk` (see `schemas.chunks`), and
- a `StatusEvent` `{"event":"status","job_id":"job_x","status":"cancelled"}`, published by
  whoever moves the job to a TERMINAL status, after the hash shows it (the transition script in
  `schemas.transitions` publishes it atomically with the change). A worker finishing a job
  publishes its final chunk first, then the event. Listeners that see an event re-read the hash.

Tell them apart with `parse_channel_message` (a chunk never has an "event" field).

Control channel `{p}:control` carries `ControlMessage` JSON, e.g.
`{"op":"cancel","job_id":"job_x"}`: every worker listens and aborts the job if it holds it (the
hash already says cancelled, so a worker that misses the message still finds out when it next
checks the hash; workers re-check the status of the jobs they run at least every few seconds).
`{"op":"lora","model":"m"}` says `m`'s run-time LoRA registry (`{p}:lora:{model}`) changed: its
workers re-read it at once (and at every heartbeat, in case they missed the message).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.chunks import TokenChunk
from schemas.jobs import JobStatus


class StatusEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    event: Literal["status"] = "status"
    job_id: str = Field(min_length=1)
    status: JobStatus

    def to_json(self) -> str:
        # The event field is part of the wire form even though it has a default.
        return self.model_dump_json()


class ControlMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Literal["cancel", "lora"]
    job_id: str | None = Field(None, min_length=1, description="the job a cancel is for")
    model: str | None = Field(None, min_length=1, description="the model whose LoRA changed")

    @model_validator(mode="after")
    def _target(self) -> ControlMessage:
        if self.op == "cancel" and self.job_id is None:
            raise ValueError("a cancel names its job_id")
        if self.op == "lora" and self.model is None:
            raise ValueError("a lora message names its model")
        return self

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> ControlMessage:
        return cls.model_validate_json(data)


def parse_channel_message(data: str | bytes) -> TokenChunk | StatusEvent:
    """Parse one message of a job channel; raises ValueError (pydantic.ValidationError or
    json.JSONDecodeError) on anything else."""
    payload = json.loads(data)
    if isinstance(payload, dict) and "event" in payload:
        return StatusEvent.model_validate(payload)
    return TokenChunk.model_validate(payload)
