"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

Each prompt becomes one job; a non-streamed call waits for the jobs, a streamed one relays
their chunks as OpenAI chunks and ends with `data: [DONE]`. A client that leaves before the
end cancels its jobs (nobody could read their output). Streams wait for the first chunk before
answering, so a job that fails at once (e.g. context_length_exceeded) is an HTTP error there too.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from producer_api.admission import (
    PromptedRequest,
    admit_jobs,
    cancel_jobs,
    check_n,
    job_failure,
)
from producer_api.deps import ApiState, Caller, State
from producer_api.errors import ApiError, error_payload, error_responses, error_status
from producer_api.openai_chunks import ChatChunks, CompletionChunks
from producer_api.openai_jobs import (
    chat_job,
    chat_max_tokens,
    check_chat,
    check_completion,
    completion_job,
    completion_prompts,
)
from producer_api.openai_models import ChatCompletionRequest, CompletionRequest
from producer_api.openai_responses import chat_body, completion_body
from producer_api.sse import sse_event
from producer_api.streams import ClientGone, merge_indexed, unless_disconnected
from producer_api.workers import ServedModel
from schemas import ErrorCode, Job, JobStatus, TokenChunk

router = APIRouter(prefix="/v1", tags=["openai"], responses=error_responses(401, 503))
# A generation answers with its job's failure too: 408 past its deadline, 409 cancelled meanwhile,
# 500 failed in the engine.
GENERATION_ERRORS = error_responses(400, 404, 408, 409, 413, 429, 500)

FINAL_STATUS_WAIT_S = 5.0
WAIT_GRACE_S = 5.0  # past the jobs' own deadline, before the API gives up waiting
DONE = b"data: [DONE]\n\n"
COMPLETIONS_PATH = "/v1/completions"

Framer = CompletionChunks | ChatChunks


@router.get("/models")
async def list_models(state: State, caller: Caller) -> dict[str, Any]:
    """Models with at least one live worker."""
    served = await state.workers.models()
    return {"object": "list", "data": [_model_card(m) for _, m in sorted(served.items())]}


@router.get("/models/{model:path}", responses=error_responses(404))
async def read_model(model: str, state: State, caller: Caller) -> dict[str, Any]:
    served = await state.require_model(model, allow_configured=False)
    assert served is not None
    return _model_card(served)


def _model_card(served: ServedModel) -> dict[str, Any]:
    """OpenAI's model object, with inferq's fields: the context, live workers, the weight
    quantization they run (None: full precision; "mixed" when they differ, each method then
    in `quantizations`) and the architectures they serve it as (e.g. ["Qwen3ForCausalLM"])."""
    return {
        "id": served.name,
        "object": "model",
        "created": int(served.since),
        "owned_by": "inferq",
        "max_model_len": served.max_model_len,
        "workers": served.workers,
        "quantization": served.quantization,
        "quantizations": list(served.quantizations),
        "architectures": list(served.architectures),
        "parent": served.parent,  # a LoRA adapter's base model, as vLLM lists adapters
        "root": served.parent or served.name,
    }


@router.post("/completions", responses=GENERATION_ERRORS)
async def completions(
    body: CompletionRequest, request: Request, state: State, caller: Caller
) -> Response:
    check_completion(body)
    check_n(state, body.n, "n")
    check_n(state, body.best_of or body.n, "best_of")
    prompts = completion_prompts(body)
    if len(prompts) > state.settings.max_prompts:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"prompt: at most {state.settings.max_prompts} prompts in one request",
            "prompt",
        )

    def build(max_tokens: int) -> Iterator[PromptedRequest]:
        for index, prompt in enumerate(prompts):
            job_request = completion_job(body, prompt, max_tokens, state.settings.request_timeout_s)
            yield job_request, "prompt" if len(prompts) == 1 else f"prompt.{index}"

    jobs = await admit_jobs(state, caller, body.model, (body.max_tokens, "max_tokens"), build)
    if body.stream:
        return await _open_stream(
            state, request, jobs, CompletionChunks(body, jobs[0]), body.include_usage
        )
    finished = await wait_all(state, request, jobs)
    return JSONResponse(completion_body(body, finished))


@router.post("/chat/completions", responses=GENERATION_ERRORS)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: State, caller: Caller
) -> Response:
    check_chat(body)
    check_n(state, body.n, "n")

    def build(max_tokens: int) -> list[PromptedRequest]:
        return [(chat_job(body, max_tokens, state.settings.request_timeout_s), "messages")]

    jobs = await admit_jobs(state, caller, body.model, chat_max_tokens(body), build)
    if body.stream:
        return await _open_stream(
            state, request, jobs, ChatChunks(body, jobs[0]), body.include_usage
        )
    finished = await wait_all(state, request, jobs)
    return JSONResponse(chat_body(body, finished[0]))


async def _cancel_all(state: ApiState, jobs: list[Job]) -> None:
    await cancel_jobs(state, jobs)


def _job_failure(job: Job, path: str) -> ApiError:
    """The HTTP error for a job that did not succeed (context_length_exceeded -> 400, ...)."""
    error = job_failure(job)
    return ApiError(error.code, error.message, error.param, status=error_status(error.code, path))


async def wait_all(state: ApiState, request: Request, jobs: list[Job]) -> list[Job]:
    """The jobs once ended; cancels them if the client goes away, and raises the first failure."""
    timeout = state.settings.request_timeout_s + WAIT_GRACE_S
    waits = asyncio.gather(*(state.wait_job(job.id, timeout) for job in jobs))
    try:
        finished = await unless_disconnected(request, waits)
    except ClientGone:
        await _cancel_all(state, jobs)
        raise _client_gone() from None
    failed = [job for job in finished if job.status is not JobStatus.SUCCEEDED]
    if failed:
        await _cancel_all(state, [job for job in finished if not job.status.is_terminal])
        raise _job_failure(failed[0], request.url.path)
    return list(finished)


def _data(payload: dict[str, Any]) -> bytes:
    return sse_event(json.dumps(payload, separators=(",", ":")))


def _client_gone() -> ApiError:
    return ApiError(ErrorCode.CANCELLED, "the client disconnected", status=499)


def _is_failure_chunk(chunk: TokenChunk | None) -> bool:
    return chunk is None or chunk.finish_reason in ("error", "abort")


async def _open_stream(
    state: ApiState, request: Request, jobs: list[Job], framer: Framer, include_usage: bool
) -> Response:
    streams = [state.stream_chunks(job.id) for job in jobs]
    firsts: list[TokenChunk | None] = []
    try:
        for job, stream in zip(jobs, streams, strict=True):
            first = await unless_disconnected(request, anext(stream, None))
            if _is_failure_chunk(first):
                ended = await state.wait_job(job.id, FINAL_STATUS_WAIT_S)
                if ended.status is not JobStatus.SUCCEEDED:
                    raise _job_failure(ended, request.url.path)
            firsts.append(first)
    except BaseException as exc:
        for stream in streams:
            await stream.aclose()
        await _cancel_all(state, jobs)
        if isinstance(exc, ClientGone):
            raise _client_gone() from None
        raise
    events = _openai_events(state, jobs, streams, firsts, framer, include_usage)
    return state.event_stream(events)


async def _with_first(first: TokenChunk | None, rest: AsyncIterator[TokenChunk]):
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk


async def _openai_events(
    state: ApiState,
    jobs: list[Job],
    streams: list[AsyncIterator[TokenChunk]],
    firsts: list[TokenChunk | None],
    framer: Framer,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    completed = False
    merged = merge_indexed(
        [_with_first(first, stream) for first, stream in zip(firsts, streams, strict=True)]
    )
    try:
        for frame in framer.start():
            yield _data(frame)
        async for position, chunk in merged:
            if chunk.finish_reason in ("error", "abort"):
                # the job's status tells what happened; only pass the text on
                if not chunk.text:
                    continue
                chunk = chunk.model_copy(update={"finish_reason": None, "stop_reason": None})
            chunk_frame = framer.chunk(position, chunk)
            if chunk_frame is not None:  # None: text held back (a tool-call tag not yet whole)
                yield _data(chunk_frame)
        finished = [await state.wait_job(job.id, FINAL_STATUS_WAIT_S) for job in jobs]
        failed = [job for job in finished if job.status is not JobStatus.SUCCEEDED]
        if failed:
            error = _job_failure(failed[0], COMPLETIONS_PATH)
            yield _data(error_payload(error.error, error.status or 500))
            completed = True
            return
        if include_usage:
            yield _data(framer.usage([job.result.usage for job in finished if job.result]))
        yield DONE
        completed = True
    finally:
        await merged.aclose()
        for stream in streams:
            await stream.aclose()
        if not completed:
            await _cancel_all(state, jobs)
