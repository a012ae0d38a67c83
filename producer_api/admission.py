"""The checks a request passes before it is enqueued: model served, `n` and `max_tokens` within
limits, the prompt within the model's vocabulary and context (producer_api.prompt_check), queue
not full. Each refusal is a 4xx naming the field."""

from __future__ import annotations

from producer_api.auth import Principal
from producer_api.deps import ApiState
from producer_api.errors import ApiError
from producer_api.prompt_check import PromptLimits, prompt_limits
from producer_api.queue import enqueue
from producer_api.workers import ServedModel
from schemas import ErrorCode, Job, JobRequest


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
    """Enqueue for the caller under the model's queue limit (QueueFullError -> 429)."""
    return await enqueue(
        state.redis,
        state.keys,
        request,
        owner=principal.owner,
        max_queue_len=state.settings.queue_limit(request.model),
        replicas=state.settings.replica_wait(),
    )


async def model_and_context(
    state: ApiState, model: str, *, allow_configured: bool
) -> tuple[ServedModel | None, int | None]:
    served = await state.require_model(model, allow_configured=allow_configured)
    return served, state.context_of(model, served)
