"""How a job looks over HTTP: the stored `Job` (owner left out), its timings and its links.

The Python HTTP client turns this view back into a `schemas.Job` with `job_of_view`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from schemas import ErrorBody, Job, JobRequest, JobResult, JobStatus, Timings


class JobLinks(BaseModel):
    self: str
    stream: str
    wait: str
    cancel: str


class JobView(BaseModel):
    """A job as `GET /v1/jobs/{id}` returns it."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: str = "job"
    status: JobStatus
    model: str
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = 0
    worker: str | None = None
    request: JobRequest
    result: JobResult | None = None
    error: ErrorBody | None = None
    timings: Timings
    links: JobLinks


def job_links(job_id: str) -> JobLinks:
    base = f"/v1/jobs/{job_id}"
    return JobLinks(self=base, stream=f"{base}/stream", wait=f"{base}/wait", cancel=base)


def job_view(job: Job) -> JobView:
    timings = (
        job.result.timings
        if job.result is not None
        else Timings.from_times(job.created_at, job.started_at, None, job.finished_at)
    )
    shown = {name: value for name, value in job if name in JobView.model_fields}
    return JobView(**shown, model=job.model, timings=timings, links=job_links(job.id))


def job_of_view(data: dict[str, Any], owner: str | None = None) -> Job:
    """The `Job` behind a view (what the HTTP client hands back, like the Redis client)."""
    fields = {name: data[name] for name in Job.model_fields if name in data and name != "owner"}
    return Job.model_validate({**fields, "owner": owner})
