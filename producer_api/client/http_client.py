"""The async client of the jobs API over HTTP (httpx), with the Redis client's method names.

    async with AsyncHttpClient("http://127.0.0.1:8000", api_key="...") as client:
        job = await client.enqueue(model="SmolLM2-135M-Instruct", prompt="Hi", stream=True)
        async for chunk in client.stream(job.id):      # resumes after a dropped connection
            print(chunk.text, end="")

Errors come back as `producer_api.queue.QueueError` (`.code`, `.error`), the same as with the
Redis client; an unknown (or someone else's) job raises `JobNotFoundError`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from producer_api.client.base import AsyncJobClient, as_request
from producer_api.client.resume import DEFAULT_MAX_RETRIES, resuming_stream
from producer_api.queue import JobNotFoundError, QueueError
from producer_api.views import job_of_view
from schemas import ErrorBody, ErrorCode, Job, JobRequest, TokenChunk

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 30.0
STREAM_READ_TIMEOUT_S = 60.0  # the server sends a keep-alive at least every 15 s
MAX_WAIT_PER_CALL_S = 60.0


class HttpError(QueueError):
    """The API refused or failed a call: `status`, the error body, and Retry-After if sent."""

    def __init__(self, error: ErrorBody, status: int, retry_after: float | None = None) -> None:
        super().__init__(error)
        self.status = status
        self.retry_after = retry_after


class ServiceUnavailable(HttpError):
    """503: the API or the queue (Redis) behind it is away for a moment; worth retrying."""


class StreamInterrupted(Exception):
    """The event stream ended before its `done` event (a proxy or the server cut it, or the
    server lost Redis mid-stream and said so in an `unavailable` error event)."""


@dataclass
class SseEvent:
    event: str = "message"
    data: str = ""
    id: str | None = None


@dataclass
class SseParser:
    """Incremental Server-Sent Events parser: feed lines, get whole events."""

    _event: str | None = None
    _data: list[str] = field(default_factory=list)
    _id: str | None = None

    def feed(self, line: str) -> SseEvent | None:
        if line == "":
            if not self._data and self._event is None:
                return None
            out = SseEvent(self._event or "message", "\n".join(self._data), self._id)
            self._event, self._data, self._id = None, [], None
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        return None


def _raise_for(response: httpx.Response, job_id: str | None = None) -> None:
    if response.status_code < 400:
        return
    try:
        payload = response.json()["error"]
        error = ErrorBody.of(ErrorCode(payload["code"]), payload["message"], payload.get("param"))
    except (ValueError, KeyError, TypeError):
        error = ErrorBody.of(
            ErrorCode.INTERNAL_ERROR, f"HTTP {response.status_code}: {response.text[:500]}"
        )
    if job_id is not None and error.code is ErrorCode.NOT_FOUND:
        raise JobNotFoundError(job_id)
    retry_after = response.headers.get("Retry-After")
    kind = ServiceUnavailable if response.status_code == 503 else HttpError
    raise kind(
        error,
        response.status_code,
        float(retry_after) if retry_after and retry_after.isdigit() else None,
    )


def _chunk_of_event(event: SseEvent) -> TokenChunk | None:
    """A chunk event's chunk; None for the closing `done` event; raises for `error`
    (StreamInterrupted, which resumes the stream, when the server lost Redis for a moment)."""
    if event.event == "chunk":
        return TokenChunk.from_json(event.data)
    if event.event == "error":
        error = ErrorBody.model_validate_json(event.data)
        if error.code is ErrorCode.UNAVAILABLE:
            raise StreamInterrupted(error.message)
        raise QueueError(error)
    return None


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _stream_headers(last_index: int) -> dict[str, str]:
    headers = {"Accept": "text/event-stream"}
    if last_index >= 0:
        headers["Last-Event-ID"] = str(last_index)
    return headers


def _body(request: JobRequest) -> dict[str, Any]:
    return request.model_dump(mode="json", exclude_none=True)


_STREAM_TIMEOUT = httpx.Timeout(DEFAULT_TIMEOUT_S, read=STREAM_READ_TIMEOUT_S)
_RETRY_ON = (httpx.TransportError, StreamInterrupted, ServiceUnavailable)


class AsyncHttpClient(AsyncJobClient):
    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        self.http = httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=timeout)
        self.max_retries = max_retries

    async def enqueue(
        self, request: JobRequest | Mapping[str, Any] | None = None, /, **fields: Any
    ) -> Job:
        response = await self.http.post("/v1/jobs", json=_body(as_request(request, fields)))
        _raise_for(response)
        return job_of_view(response.json())

    async def get(self, job_id: str) -> Job:
        response = await self.http.get(f"/v1/jobs/{job_id}")
        _raise_for(response, job_id)
        return job_of_view(response.json())

    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            left = MAX_WAIT_PER_CALL_S if give_up is None else give_up - time.monotonic()
            chunk = max(min(left, MAX_WAIT_PER_CALL_S), 0.0)
            response = await self.http.get(
                f"/v1/jobs/{job_id}/wait",
                params={"timeout": chunk},
                timeout=chunk + DEFAULT_TIMEOUT_S,
            )
            _raise_for(response, job_id)
            job = job_of_view(response.json())
            if job.status.is_terminal or (give_up is not None and time.monotonic() >= give_up):
                return job

    def stream(self, job_id: str, last_index: int = -1) -> AsyncIterator[TokenChunk]:
        """The job's chunks after `last_index`, each once, in order, until the job ends;
        reconnects with Last-Event-ID when the connection drops."""
        return resuming_stream(
            lambda after: self._stream_once(job_id, after), last_index, _RETRY_ON, self.max_retries
        )

    async def _stream_once(self, job_id: str, last_index: int) -> AsyncIterator[TokenChunk]:
        async with self.http.stream(
            "GET",
            f"/v1/jobs/{job_id}/stream",
            headers=_stream_headers(last_index),
            timeout=_STREAM_TIMEOUT,
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                _raise_for(response, job_id)
            parser = SseParser()
            async for line in response.aiter_lines():
                event = parser.feed(line)
                if event is None:
                    continue
                chunk = _chunk_of_event(event)
                if chunk is None:
                    return
                yield chunk
        raise StreamInterrupted(f"the stream of {job_id} ended before its done event")

    async def cancel(self, job_id: str) -> Job:
        response = await self.http.delete(f"/v1/jobs/{job_id}")
        _raise_for(response, job_id)
        return job_of_view(response.json())

    async def aclose(self) -> None:
        await self.http.aclose()
