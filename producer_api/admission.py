"""The checks a request passes before it is enqueued: model served, `n` and `max_tokens` within
limits, the prompt within the model's vocabulary and context (producer_api.prompt_check), queue
not full. Each refusal is a 4xx (or gRPC status) naming the field.

`admit_jobs` runs them all for the generation interfaces (OpenAI routes, gRPC), and
`admit_embeddings` for embeddings (/v1/embeddings, /v1/score, gRPC); callers then wait
for their jobs, cancel them when the caller leaves (`cancel_jobs`), and report a job that did
not succeed as its error (`job_failure`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

import anyio

from producer_api import queue
from producer_api.auth import Principal
from producer_api.deps import ApiState
from producer_api.errors import ApiError
from producer_api.lora import on_base_model
from producer_api.openai_embeddings import embedding_job, inputs_job
from producer_api.prompt_check import PromptLimits, check_prompt, prompt_limits
from producer_api.queue import enqueue
from producer_api.workers import ServedModel
from schemas import ErrorBody, ErrorCode, Job, JobKind, JobRequest, JobStatus
from schemas.pooling import PoolingParams

# A job request and the request field its prompt came from (named in a refusal).
PromptedRequest = tuple[JobRequest, str]


def check_n(state: ApiState, n: int, param: str) -> None:
    limit = state.settings.max_n
    if n > limit:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"{param}: at most {limit} choices", param)


def resolve_max_tokens(
    state: ApiState, requested: int | None, context: int | None, param: str
) -> int:
    """`requested`, checked against the model's context; the default when None (the configured
    default, cut to the context)."""
    if requested is None:
        default = state.settings.default_max_tokens
        return default if context is None else max(1, min(default, context - 1))
    if context is not None and requested >= context:
        raise ApiError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"This model's maximum context length is {context} tokens; {param} is {requested}, "
            "which leaves no room for the prompt. Lower it.",
            param,
        )
    return requested


async def limits_of(
    state: ApiState, served: ServedModel | None, context: int | None
) -> PromptLimits:
    """What the model's workers accept, for `check_prompt` (producer_api.prompt_check)."""
    return await prompt_limits(served, context, state.tokenizers)


async def submit(state: ApiState, request: JobRequest, principal: Principal) -> Job:
    """Enqueue for the caller under the model's queue limit (QueueFullError -> 429); a request
    for a LoRA adapter goes to its base model's queue (producer_api.lora)."""
    request = on_base_model(request, await state.workers.models())
    return await enqueue(
        state.redis,
        state.keys,
        request,
        owner=principal.owner,
        max_queue_len=state.settings.queue_limit(request.model),
        replicas=state.settings.replica_wait(),
    )


def check_task(served: ServedModel | None, kind: JobKind) -> None:
    """400 naming the task when the model's live workers take no job of this kind (an
    embedding model asked to generate, or the other way round)."""
    if served is None or not served.tasks or kind in served.tasks:
        return
    serves = ", ".join(sorted(task.value for task in served.tasks))
    raise ApiError(
        ErrorCode.INVALID_REQUEST,
        f"model: {served.name!r} serves {serves} jobs, not {kind.value}",
        "model",
    )


async def model_and_context(
    state: ApiState, model: str, *, allow_configured: bool
) -> tuple[ServedModel | None, int | None]:
    served = await state.require_model(model, allow_configured=allow_configured)
    return served, state.context_of(model, served)


async def admit_jobs(
    state: ApiState,
    caller: Principal,
    model: str,
    max_tokens: tuple[int | None, str],
    build: Callable[[int], Iterable[PromptedRequest]],
) -> list[Job]:
    """Check the model (it must have a live worker), resolve `max_tokens` (requested, and the
    field it came from) against its context, `build` the job requests with it (checking each
    prompt against the model as it comes), and enqueue them all or none (a refusal cancels those queued)."""
    served, context = await model_and_context(state, model, allow_configured=False)
    check_task(served, JobKind.GENERATION)
    requested, param = max_tokens
    resolved = resolve_max_tokens(state, requested, context, param)
    limits = await limits_of(state, served, context)
    requests = []
    for job_request, prompt_param in build(resolved):
        await check_prompt(job_request, limits, prompt_param)
        requests.append(job_request)
    return await submit_all(state, caller, requests)


async def admit_embeddings(
    state: ApiState,
    caller: Principal,
    model: str,
    inputs: Sequence[tuple[str | list[int], str]],
    dimensions: int | None,
    timeout_s: float,
) -> list[Job]:
    """Check the model serves embeddings (and `dimensions`), each input (with the request
    field it came from, named on refusal) against it, and queue one embedding job carrying
    them all (`inputs`; a job of its own for a single input)."""
    served, context = await model_and_context(state, model, allow_configured=False)
    check_task(served, JobKind.EMBEDDING)
    size = served.embedding_size if served is not None else None
    if dimensions is not None and size is not None and dimensions > size:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"dimensions: {dimensions} is more than this model's {size}",
            "dimensions",
        )
    limits = await limits_of(state, served, context)
    pooling = PoolingParams(dimensions=dimensions)
    requests = []
    for item, param in inputs:
        job_request = embedding_job(model, item, pooling, timeout_s, param)
        await check_prompt(job_request, limits, param)
        requests.append(job_request)
    return [await submit(state, inputs_job(requests), caller)]


async def submit_all(
    state: ApiState, caller: Principal, requests: Sequence[JobRequest]
) -> list[Job]:
    """Enqueue the checked requests all or none (a refusal cancels those already queued)."""
    jobs: list[Job] = []
    try:
        for job_request in requests:
            jobs.append(await submit(state, job_request, caller))
    except BaseException:
        await cancel_jobs(state, jobs)
        raise
    return jobs


async def cancel_jobs(
    state: ApiState, jobs: Sequence[Job], reason: str = "client went away"
) -> None:
    """Cancel the jobs, best effort (each job's deadline ends it anyway), even while the
    caller's own task is being cancelled."""
    with anyio.CancelScope(shield=True):
        for job in jobs:
            with contextlib.suppress(Exception):
                await queue.cancel_job(state.redis, state.keys, job.id, reason=reason)


def job_failure(job: Job) -> ErrorBody:
    """Why a job that ended, or was given up on, did not succeed."""
    if job.status is JobStatus.SUCCEEDED:
        raise ValueError("job succeeded")
    if job.error is not None:
        return job.error
    if job.status.is_terminal:
        code = ErrorCode.CANCELLED if job.status is JobStatus.CANCELLED else ErrorCode.EXPIRED
        return ErrorBody.of(code, f"the job ended as {job.status.value}")
    return ErrorBody.of(ErrorCode.DEADLINE_EXCEEDED, "the job did not finish in time")
