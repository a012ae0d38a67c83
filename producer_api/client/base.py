"""What every async client does, whatever its transport: the one interface the facade and the
blocking wrapper rely on."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any, Self

from producer_api.queue import QueueError
from schemas import ErrorBody, ErrorCode, Job, JobRequest, JobStatus, TokenChunk
from schemas.jobs import MAX_EMBEDDING_INPUTS
from schemas.pooling import PoolingParams


def as_request(
    request: JobRequest | Mapping[str, Any] | None, fields: Mapping[str, Any]
) -> JobRequest:
    """A JobRequest from a JobRequest, a dict, and/or keyword fields (validated here)."""
    if isinstance(request, JobRequest):
        if fields:
            return JobRequest.model_validate({**request.model_dump(exclude_none=True), **fields})
        return request
    return JobRequest.model_validate({**(request or {}), **fields})


async def close_stream(chunks: AsyncIterator[object]) -> None:
    """Close a stream early, so an async generator releases its connection or subscription now
    rather than whenever it is collected (a plain iterator holds nothing to release)."""
    if isinstance(chunks, AsyncGenerator):
        await chunks.aclose()


class AsyncJobClient(ABC):
    """enqueue, get, wait, stream, cancel and run, as an async context manager. Errors are
    `producer_api.queue.QueueError`; an unknown (or someone else's) job is `JobNotFoundError`."""

    @abstractmethod
    async def enqueue(
        self, request: JobRequest | Mapping[str, Any] | None = None, /, **fields: Any
    ) -> Job:
        """Queue a job: pass a JobRequest, a dict, or its fields as keywords (validated)."""

    @abstractmethod
    async def get(self, job_id: str) -> Job:
        """The job as it stands now."""

    @abstractmethod
    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """The job once terminal, or as it stands after `timeout` seconds."""

    @abstractmethod
    def stream(self, job_id: str, last_index: int = -1) -> AsyncIterator[TokenChunk]:
        """The job's chunks after `last_index`, each once, in order, until the job ends."""

    @abstractmethod
    async def cancel(self, job_id: str) -> Job:
        """Cancel the job (queued or running) and return it as it stands."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release the connections the client owns."""

    async def run(
        self,
        request: JobRequest | Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | None = None,
        **fields: Any,
    ) -> Job:
        """Enqueue and wait: the finished job (or the job as it stands after `timeout`)."""
        job = await self.enqueue(request, **fields)
        return await self.wait(job.id, timeout=timeout)

    async def embed(
        self,
        model: str,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        dimensions: int | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> list[list[float]]:
        """Embed the inputs (texts or token ids) as embedding jobs of `model`, up to
        MAX_EMBEDDING_INPUTS inputs a job (the worker runs each input as its own sequence);
        the vectors in input order. A job that does not succeed raises its error as a
        QueueError."""
        items = [inputs] if isinstance(inputs, str) else list(inputs)
        pooling = PoolingParams(dimensions=dimensions)
        jobs = []
        for start in range(0, len(items), MAX_EMBEDDING_INPUTS):
            part = [
                i if isinstance(i, str) else list(i)
                for i in items[start : start + MAX_EMBEDDING_INPUTS]
            ]
            if len(part) > 1:
                given: dict[str, Any] = {"inputs": part}
            elif isinstance(part[0], str):
                given = {"prompt": part[0]}
            else:
                given = {"prompt_token_ids": part[0]}
            jobs.append(await self.enqueue(model=model, pooling=pooling, **given, **fields))
        finished = await asyncio.gather(*(self.wait(job.id, timeout=timeout) for job in jobs))
        vectors: list[list[float]] = []
        for job in finished:
            if job.status is not JobStatus.SUCCEEDED or job.result is None:
                raise QueueError(job.error or _unfinished(job))
            if job.result.embeddings is not None:
                vectors.extend(job.result.embeddings)
            else:
                assert job.result.embedding is not None
                vectors.append(job.result.embedding)
        return vectors

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _unfinished(job: Job) -> ErrorBody:
    code = ErrorCode.DEADLINE_EXCEEDED if not job.status.is_terminal else ErrorCode.CANCELLED
    return ErrorBody.of(code, f"job {job.id} ended as {job.status.value}")
