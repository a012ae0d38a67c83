"""OpenAI-compatible Files and Batch endpoints: /v1/files and /v1/batches.

An owner sees only its own files and batches (anyone else gets the same 404 as for none).
Invalid requests are 400 with OpenAI's error body, as OpenAI answers them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from producer_api.auth import Principal
from producer_api.batches.controller import submit_batch
from producer_api.batches.files import (
    BATCH_PURPOSE,
    FileStore,
    StoredFile,
    UploadError,
    validate_upload,
)
from producer_api.batches.store import CANCELLABLE, BatchStore, now_s
from producer_api.deps import Caller, State
from producer_api.errors import ApiError, error_responses
from schemas import BatchObject, BatchStatus, ErrorCode, FileObject
from schemas.batches import (
    BATCH_ENDPOINTS,
    MAX_BATCH_METADATA_PAIRS,
    completion_window_seconds,
)

router = APIRouter(prefix="/v1", tags=["batches"], responses=error_responses(401, 503))


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=MAX_BATCH_METADATA_PAIRS)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(ErrorCode.INVALID_REQUEST, message, param, status=400)


def _page(items: Sequence[BaseModel], has_more: bool) -> dict[str, Any]:
    """OpenAI's list envelope (cursor pagination by id)."""
    data = [item.model_dump(mode="json") for item in items]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _not_found(what: str, ident: str) -> ApiError:
    return ApiError(ErrorCode.NOT_FOUND, f"no {what} {ident!r}", status=404)


async def _visible_file(state: State, file_id: str, caller: Principal) -> StoredFile:
    stored = await FileStore(state.redis, state.keys).get(file_id)
    if stored is None or stored.owner != caller.owner:
        raise _not_found("file", file_id)
    return stored


@router.post("/files", responses=error_responses(400, 413))
async def upload_file(
    state: State,
    caller: Caller,
    file: Annotated[UploadFile, File(description="a JSONL batch input file")],
    purpose: Annotated[str, Form()],
) -> dict[str, Any]:
    """Upload a batch input file; every line is validated now and the file is refused when it
    is too big, too long, or has no valid line. Single bad lines are kept and reported: the
    batch writes them to its error file."""
    if purpose != BATCH_PURPOSE:
        raise _bad(f"purpose: only {BATCH_PURPOSE!r} is supported", "purpose")
    settings = state.settings
    raw = await file.read(settings.max_file_bytes + 1)
    try:
        summary = validate_upload(
            raw,
            max_bytes=settings.max_file_bytes,
            max_lines=settings.max_batch_lines,
            default_max_tokens=settings.default_max_tokens,
        )
    except UploadError as exc:
        raise _bad(str(exc), "file") from exc
    stored = await FileStore(state.redis, state.keys).save(
        owner=caller.owner,
        filename=file.filename or "batch.jsonl",
        purpose=purpose,
        content=raw,  # UTF-8, checked by validate_upload
        created_at=now_s(),
        ttl_s=settings.file_retention_s,
    )
    body = stored.model_dump()
    first = summary.first_invalid
    if first is not None:
        reason = first.error.message if first.error else "invalid"
        body["status_details"] = (
            f"{summary.invalid} of {summary.lines} lines are invalid and will go to the batch's "
            f"error file (first: line {first.number}: {reason})"
        )
    return body


@router.get("/files", responses=error_responses(400))
async def list_files(
    state: State,
    caller: Caller,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """The caller's files (uploads and batch outputs) until their retention ends."""
    files, has_more = await FileStore(state.redis, state.keys).list(
        caller.owner, limit=limit, purpose=purpose, after=after, newest_first=order == "desc"
    )
    return _page(files, has_more)


@router.delete("/files/{file_id}", responses=error_responses(404, 409))
async def delete_file(file_id: str, state: State, caller: Caller) -> dict[str, Any]:
    """Free a file's Redis memory before its retention ends. Refused (409) while a batch
    still reads it as its input."""
    await _visible_file(state, file_id, caller)
    running = await BatchStore(state.redis, state.keys).running_on(file_id)
    if running is not None:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"the file is the input of batch {running!r}, which is still running",
            "file_id",
            status=409,
        )
    if not await FileStore(state.redis, state.keys).delete(file_id, caller.owner):
        raise _not_found("file", file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.get("/files/{file_id}", responses=error_responses(404))
async def read_file(file_id: str, state: State, caller: Caller) -> FileObject:
    return (await _visible_file(state, file_id, caller)).info


@router.get(
    "/files/{file_id}/content",
    response_class=Response,
    responses={200: {"content": {"application/jsonl": {}}}, **error_responses(404)},
)
async def file_content(file_id: str, state: State, caller: Caller) -> Response:
    await _visible_file(state, file_id, caller)
    parts = FileStore(state.redis, state.keys).content_parts(file_id)
    first = await anext(parts, None)
    if first is None:
        raise _not_found("file", file_id)

    async def body() -> AsyncIterator[bytes]:  # a batch's output: part by part, not whole
        yield first.encode()
        async for part in parts:
            yield part.encode()

    return StreamingResponse(body(), media_type="application/jsonl")


@router.post("/batches", responses=error_responses(400, 413))
async def create_batch(body: CreateBatch, state: State, caller: Caller) -> BatchObject:
    if body.endpoint not in BATCH_ENDPOINTS:
        raise _bad(f"endpoint: must be one of {', '.join(BATCH_ENDPOINTS)}", "endpoint")
    try:
        window_s = completion_window_seconds(body.completion_window)
    except ValueError as exc:
        raise _bad(str(exc), "completion_window") from exc
    stored = await FileStore(state.redis, state.keys).get(body.input_file_id)
    if stored is None or stored.owner != caller.owner:
        raise _bad(f"input_file_id: no file {body.input_file_id!r}", "input_file_id")
    if stored.info.purpose != BATCH_PURPOSE:
        raise _bad("input_file_id: the file's purpose is not 'batch'", "input_file_id")
    batch = await BatchStore(state.redis, state.keys).create(
        owner=caller.owner,
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        window_s=window_s,
        metadata=body.metadata,
    )
    await submit_batch(state.settings, state.keys, batch.id)
    return batch


async def _visible_batch(state: State, batch_id: str, caller: Principal) -> BatchObject:
    store = BatchStore(state.redis, state.keys)
    data = await store.raw(batch_id)
    if not data or (data.get("owner") or None) != caller.owner:
        raise _not_found("batch", batch_id)
    return BatchObject.from_redis_hash(data)


@router.get("/batches/{batch_id}", responses=error_responses(404))
async def read_batch(batch_id: str, state: State, caller: Caller) -> BatchObject:
    return await _visible_batch(state, batch_id, caller)


@router.post("/batches/{batch_id}/cancel", responses=error_responses(404, 409, 413))
async def cancel_batch(batch_id: str, state: State, caller: Caller) -> BatchObject:
    """Ask the controller to stop: status `cancelling` now, `cancelled` once the jobs still out
    are cancelled; results already in stay in the output file."""
    batch = await _visible_batch(state, batch_id, caller)
    store = BatchStore(state.redis, state.keys)
    applied, current = await store.set_status(batch_id, BatchStatus.CANCELLING, CANCELLABLE)
    if not applied and current not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        status = current.value if current else batch.status.value
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"the batch is {status} and can no longer be cancelled",
            status=409,
        )
    return await _visible_batch(state, batch_id, caller)


@router.get("/batches", responses=error_responses(400))
async def list_batches(
    state: State,
    caller: Caller,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> dict[str, Any]:
    batches, has_more = await BatchStore(state.redis, state.keys).list(
        caller.owner, limit=limit, after=after
    )
    return _page(batches, has_more)
