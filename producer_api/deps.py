"""What every route needs: the app's shared state, the caller, and checks on the model asked for."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.asyncio import Redis

from producer_api import queue
from producer_api.auth import KeyTable, Principal, Unauthenticated, authenticate
from producer_api.errors import ApiError
from producer_api.metrics import ApiMetrics
from producer_api.prompt_tokens import TokenizerCache
from producer_api.settings import ApiSettings
from producer_api.sse import EventStreamResponse
from producer_api.workers import ServedModel, WorkerDirectory
from schemas import ErrorCode, Job, RedisKeys, TokenChunk


@dataclass
class ApiState:
    settings: ApiSettings
    redis: Redis
    keys: RedisKeys
    key_table: KeyTable
    workers: WorkerDirectory
    metrics: ApiMetrics
    tokenizers: TokenizerCache

    async def served_model(self, model: str) -> ServedModel | None:
        return (await self.workers.models()).get(model)

    async def require_model(self, model: str, *, allow_configured: bool) -> ServedModel | None:
        """The model's live workers; 404 model_not_found when none serve it (unless it is one of
        the configured `models` and `allow_configured`: jobs may then wait for a worker)."""
        served = await self.served_model(model)
        if served is None and not (allow_configured and model in self.settings.models):
            raise ApiError(
                ErrorCode.MODEL_NOT_FOUND,
                f"The model {model!r} does not exist or no worker serves it right now",
                "model",
            )
        return served

    async def wait_job(self, job_id: str, timeout: float) -> Job:
        """The job once it has ended, or as it stands after `timeout` seconds."""
        return await queue.wait_job(
            self.redis,
            self.keys,
            job_id,
            timeout=timeout,
            poll_interval=self.settings.poll_interval_s,
        )

    def stream_chunks(self, job_id: str, last_index: int = -1) -> AsyncIterator[TokenChunk]:
        """The job's chunks after `last_index`, live (see `queue.stream_chunks`)."""
        return queue.stream_chunks(
            self.redis,
            self.keys,
            job_id,
            last_index=last_index,
            poll_interval=self.settings.poll_interval_s,
        )

    def event_stream(self, events: AsyncIterator[bytes]) -> EventStreamResponse:
        return EventStreamResponse(events, self.metrics, keepalive_s=self.settings.sse_keepalive_s)

    def context_of(self, model: str, served: ServedModel | None) -> int | None:
        if served is not None and served.max_model_len is not None:
            return served.max_model_len
        return self.settings.model_context.get(model)


def get_state(request: Request) -> ApiState:
    return request.app.state.inferq


_bearer = HTTPBearer(auto_error=False, description="an API key: `Authorization: Bearer <key>`")


def get_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    state = get_state(request)
    key = credentials.credentials if credentials is not None else None
    try:
        return authenticate(state.key_table, key, auth_disabled=state.settings.auth_disabled)
    except Unauthenticated as exc:
        raise _unauthorized(str(exc)) from None


def _unauthorized(message: str) -> ApiError:
    return ApiError(
        ErrorCode.UNAUTHORIZED, message, status=401, headers={"WWW-Authenticate": "Bearer"}
    )


def check_visible(job: Job, principal: Principal) -> Job:
    """A job is visible to its owner only; anyone else gets the same 404 as for no job."""
    if job.owner != principal.owner:
        raise ApiError(ErrorCode.NOT_FOUND, f"no job {job.id!r}")
    return job


State = Annotated[ApiState, Depends(get_state)]
Caller = Annotated[Principal, Depends(get_principal)]
