"""The jobs API: create, read, stream (SSE, resumable), wait for, and cancel jobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse

from producer_api import queue
from producer_api.admission import (
    check_n,
    check_task,
    limits_of,
    model_and_context,
    resolve_max_tokens,
    submit,
)
from producer_api.deps import ApiState, Caller, State, check_visible
from producer_api.errors import ApiError, error_responses
from producer_api.prompt_check import check_prompt
from producer_api.sse import EventStreamResponse, sse_event
from producer_api.views import JobView, job_view
from schemas import ErrorCode, Job, JobRequest
from schemas.jobs import MAX_IDEMPOTENCY_KEY_CHARS

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 503))

# How long the stream's closing event waits for the job to reach its terminal status after the
# final chunk (the worker writes the chunk and the status in one pipeline: normally at once).
FINAL_STATUS_WAIT_S = 5.0
# Every route that answers with a job shows it as `JobView`, unset fields left out.
_JOB_VIEW: dict[str, Any] = {"response_model": JobView, "response_model_exclude_none": True}


@router.post("", status_code=202, **_JOB_VIEW, responses=error_responses(404, 413, 422, 429))
async def create_job(
    body: JobRequest,
    state: State,
    caller: Caller,
    idempotency_key: Annotated[
        str | None,
        Header(alias="Idempotency-Key", min_length=1, max_length=MAX_IDEMPOTENCY_KEY_CHARS),
    ] = None,
) -> JSONResponse:
    """Queue a job. With an idempotency key (header or field), repeating the call returns the
    first job instead of queueing another."""
    if idempotency_key is not None:
        if body.idempotency_key not in (None, idempotency_key):
            raise ApiError(
                ErrorCode.INVALID_REQUEST,
                "idempotency_key: differs from the Idempotency-Key header",
                "idempotency_key",
            )
        try:
            body = body.model_copy(update={"idempotency_key": idempotency_key})
            body = JobRequest.model_validate(body.model_dump(exclude_none=True))
        except ValueError as exc:
            raise ApiError(
                ErrorCode.INVALID_REQUEST, f"Idempotency-Key: {exc}", "Idempotency-Key"
            ) from exc
    served, context = await model_and_context(state, body.model, allow_configured=True)
    check_task(served, body.kind)
    check_n(state, body.sampling.n, "sampling.n")
    check_n(state, body.sampling.num_candidates, "sampling.best_of")
    resolve_max_tokens(state, body.sampling.max_tokens, context, "sampling.max_tokens")
    limits = await limits_of(state, served, context)
    await check_prompt(body, limits, body.input_kind, sampling_prefix="sampling.")
    job = await submit(state, body, caller)
    view = job_view(job)
    return JSONResponse(
        view.model_dump(mode="json", exclude_none=True),
        status_code=202,
        headers={"Location": view.links.self},
    )


async def _visible_job(state: ApiState, job_id: str, caller: Caller) -> Job:
    return check_visible(await queue.get_job(state.redis, state.keys, job_id), caller)


@router.get("/{job_id}", **_JOB_VIEW, responses=error_responses(404))
async def read_job(job_id: str, state: State, caller: Caller) -> JobView:
    """The job's status, and its result, error and timings once it has them."""
    return job_view(await _visible_job(state, job_id, caller))


@router.delete("/{job_id}", **_JOB_VIEW, responses=error_responses(404))
async def cancel_job(job_id: str, state: State, caller: Caller) -> JobView:
    """Cancel a queued or running job (a finished job is returned as it is)."""
    await _visible_job(state, job_id, caller)
    return job_view(await queue.cancel_job(state.redis, state.keys, job_id))


@router.get("/{job_id}/wait", **_JOB_VIEW, responses=error_responses(404, 422))
async def wait_for_job(
    job_id: str,
    state: State,
    caller: Caller,
    timeout: Annotated[float, Query(ge=0, le=3600, description="seconds")] = 30.0,
) -> JobView:
    """The job once it has finished, or as it stands after `timeout` seconds (capped by the
    server's max_wait_s): check `status`."""
    await _visible_job(state, job_id, caller)
    return job_view(await state.wait_job(job_id, min(timeout, state.settings.max_wait_s)))


def _resume_index(header: str | None, query: int | None) -> int:
    if query is not None:
        return query
    if header is None or header == "":
        return -1
    try:
        value = int(header)
    except ValueError:
        value = -2
    if value < -1:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            "Last-Event-ID: must be the id of a chunk event (a chunk index)",
            "Last-Event-ID",
        )
    return value


@router.get(
    "/{job_id}/stream",
    response_class=EventStreamResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "SSE of chunks"},
        **error_responses(404, 422),
    },
)
async def stream_job(
    job_id: str,
    request: Request,
    state: State,
    caller: Caller,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=32)] = None,
    after: Annotated[
        int | None, Query(ge=-1, description="resume after this chunk index (as Last-Event-ID)")
    ] = None,
) -> EventStreamResponse:
    """Server-Sent Events: `event: chunk` (id = chunk index, data = chunk JSON) for every chunk
    after `Last-Event-ID`, then one `event: done` whose data is the job. Reconnecting with the
    last id seen resumes without loss or repeats."""
    last_index = _resume_index(last_event_id, after)
    await _visible_job(state, job_id, caller)
    return state.event_stream(_job_events(state, job_id, last_index))


async def _job_events(state: ApiState, job_id: str, last_index: int) -> AsyncIterator[bytes]:
    chunks = state.stream_chunks(job_id, last_index)
    try:
        async for chunk in chunks:
            yield sse_event(chunk.to_json(), event="chunk", event_id=str(chunk.index))
        job = await state.wait_job(job_id, FINAL_STATUS_WAIT_S)
    except queue.QueueError as exc:
        yield sse_event(exc.error.model_dump_json(exclude_none=True), event="error")
        return
    finally:
        await chunks.aclose()
    yield sse_event(job_view(job).model_dump_json(exclude_none=True), event="done")
