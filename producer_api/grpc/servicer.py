"""The `inferq.v1.Inference` service: the HTTP API's jobs over gRPC, on the same state and the
same admission (`producer_api.admission`), keys (`producer_api.auth`) and Redis path
(`producer_api.queue`).

A call that ends before its job (the client cancels, its deadline passes, it drops the
connection) cancels the job, so its KV blocks are freed at once, unless the request says
`keep_running`; the job's deadline is the call's deadline when that is sooner, so a worker also
ends it by itself. A stream resumed by job id never cancels the job: resuming is for jobs that
keep running.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator

from grpc import aio

from producer_api import queue
from producer_api.admission import (
    PromptedRequest,
    admit_embeddings,
    admit_jobs,
    cancel_jobs,
    check_n,
    job_failure,
)
from producer_api.auth import Principal, authenticate, bearer_token
from producer_api.deps import ApiState
from producer_api.errors import ApiError
from producer_api.grpc.requests import (
    GenerationRequest,
    embedding_inputs,
    job_request,
    prompt_field,
    requested_dimensions,
    requested_max_tokens,
    requested_n,
)
from producer_api.grpc.responses import (
    chunk_message,
    completions_response,
    embedding_response,
    job_message,
    model_message,
)
from producer_api.grpc.status import stream_errors, unary_errors
from producer_api.grpc.stubs import inference_pb2 as pb
from producer_api.grpc.stubs import inference_pb2_grpc
from schemas import ErrorCode, Job, JobStatus, TokenChunk, utc_now

AUTHORIZATION_KEY = "authorization"
FINAL_STATUS_WAIT_S = 5.0  # the worker stores the result in the pipeline of the final chunk
WAIT_GRACE_S = 5.0  # past a job's own deadline, before a call gives up waiting for it
MIN_CALL_TIMEOUT_S = 0.001  # a call whose deadline has all but passed still makes a valid job
_FAILED_CHUNK = ("error", "abort")


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, state: ApiState) -> None:
        self.state = state
        self.retry_after_s = state.settings.retry_after_s

    @unary_errors
    async def CreateCompletion(
        self, request: pb.CompletionsRequest, context: aio.ServicerContext
    ) -> pb.CompletionsResponse:
        job = await self._admit(request, self._caller(context), context, stream=False)
        return await self._finished(job, request.keep_running)

    @unary_errors
    async def CreateChatCompletion(
        self, request: pb.ChatCompletionsRequest, context: aio.ServicerContext
    ) -> pb.CompletionsResponse:
        job = await self._admit(request, self._caller(context), context, stream=False)
        return await self._finished(job, request.keep_running)

    @stream_errors
    async def StreamCompletion(
        self, request: pb.StreamCompletionRequest, context: aio.ServicerContext
    ) -> AsyncGenerator[pb.CompletionChunk, None]:
        caller = self._caller(context)
        start = request.WhichOneof("start")
        if start != "job_id" and request.HasField("after_chunk"):
            raise _invalid("after_chunk", "resumes the stream of a job_id only")
        if start == "job_id":
            job = await self._visible_job(request.job_id, caller)
            after = request.after_chunk if request.HasField("after_chunk") else -1
            if after < -1:
                raise _invalid("after_chunk", "must be a chunk number (or -1: from the start)")
            keep_running = True
        elif start == "completion" or start == "chat":
            generation = request.completion if start == "completion" else request.chat
            job = await self._admit(generation, caller, context, stream=True)
            after, keep_running = -1, generation.keep_running
        else:
            raise _invalid("completion", "give completion, chat or job_id")
        completed = False
        try:
            async for message in self._chunks(job, after):
                yield message
            completed = True
        finally:
            if not completed and not keep_running:
                await cancel_jobs(self.state, [job])

    @unary_errors
    async def GetJob(self, request: pb.GetJobRequest, context: aio.ServicerContext) -> pb.Job:
        return job_message(await self._visible_job(request.job_id, self._caller(context)))

    @unary_errors
    async def CancelJob(self, request: pb.CancelJobRequest, context: aio.ServicerContext) -> pb.Job:
        await self._visible_job(request.job_id, self._caller(context))
        return job_message(
            await queue.cancel_job(self.state.redis, self.state.keys, request.job_id)
        )

    @unary_errors
    async def CreateEmbedding(
        self, request: pb.EmbeddingRequest, context: aio.ServicerContext
    ) -> pb.EmbeddingResponse:
        caller = self._caller(context)
        inputs = embedding_inputs(request, self.state.settings.max_embedding_inputs)
        dimensions = requested_dimensions(request)
        own_timeout = request.timeout_s if request.HasField("timeout_s") else None
        timeout_s = self._timeout(own_timeout, False, context)
        jobs = await admit_embeddings(
            self.state, caller, request.model_id, inputs, dimensions, timeout_s
        )
        ended: dict[str, Job] = {}
        try:
            for job in jobs:
                ended[job.id] = done = await self._ended(job)
                if done.status is not JobStatus.SUCCEEDED or done.result is None:
                    raise _failure(done)
        finally:
            # cancelled (client gone, deadline), one failed, or given up on: free the rest
            left = [j for j in jobs if j.id not in ended or not ended[j.id].status.is_terminal]
            if left:
                await cancel_jobs(self.state, left)
        return embedding_response(request.model_id, [ended[job.id] for job in jobs])

    @unary_errors
    async def ListModels(
        self, request: pb.ListModelsRequest, context: aio.ServicerContext
    ) -> pb.ListModelsResponse:
        self._caller(context)
        served = await self.state.workers.models()
        return pb.ListModelsResponse(models=[model_message(m) for _, m in sorted(served.items())])

    def _caller(self, context: aio.ServicerContext) -> Principal:
        key = None
        for name, value in context.invocation_metadata() or ():
            if name == AUTHORIZATION_KEY and isinstance(value, str):
                key = bearer_token(value)
        settings = self.state.settings
        return authenticate(self.state.key_table, key, auth_disabled=settings.auth_disabled)

    async def _visible_job(self, job_id: str, caller: Principal) -> Job:
        """The caller's job; another key's job is PERMISSION_DENIED (ids are unguessable, so
        whoever holds one was given it)."""
        job = await queue.get_job(self.state.redis, self.state.keys, job_id)
        if job.owner != caller.owner:
            raise ApiError(
                ErrorCode.FORBIDDEN, f"job {job_id!r} belongs to another API key", "job_id"
            )
        return job

    async def _admit(
        self,
        request: GenerationRequest,
        caller: Principal,
        context: aio.ServicerContext,
        *,
        stream: bool,
    ) -> Job:
        check_n(self.state, requested_n(request), "n")
        if request.HasField("best_of"):
            check_n(self.state, request.best_of, "best_of")
        timeout_s = self._job_timeout(request, context)

        def build(max_tokens: int) -> Iterator[PromptedRequest]:
            job = job_request(request, max_tokens, stream=stream, timeout_s=timeout_s)
            yield job, prompt_field(request)

        max_tokens = requested_max_tokens(request)
        jobs = await admit_jobs(self.state, caller, request.model_id, max_tokens, build)
        return jobs[0]

    def _job_timeout(self, request: GenerationRequest, context: aio.ServicerContext) -> float:
        own = request.timeout_s if request.HasField("timeout_s") else None
        return self._timeout(own, request.keep_running, context)

    def _timeout(
        self, own: float | None, keep_running: bool, context: aio.ServicerContext
    ) -> float:
        """The job's deadline from now: its own timeout_s or the call's deadline, the sooner;
        the configured request timeout when neither is given. A job that keeps running is not
        bound to the call's deadline."""
        limits = []
        if own is not None:
            limits.append(own)
        remaining = None if keep_running else context.time_remaining()
        if remaining is not None:
            limits.append(max(remaining, MIN_CALL_TIMEOUT_S))
        return min(limits) if limits else self.state.settings.request_timeout_s

    async def _ended(self, job: Job) -> Job:
        """The job once it has ended, or as it stands once its deadline (and a grace) passed."""
        deadline = job.request.deadline
        wait_s = self.state.settings.request_timeout_s
        if deadline is not None:
            wait_s = max((deadline - utc_now()).total_seconds(), 0.0)
        return await self.state.wait_job(job.id, wait_s + WAIT_GRACE_S)

    async def _finished(self, job: Job, keep_running: bool) -> pb.CompletionsResponse:
        """The job's response once it has succeeded; its failure as the call's status."""
        ended = job
        try:
            ended = await self._ended(job)
        finally:
            # cancelled (client gone, deadline), failed, or given up on: free the job's blocks
            if not keep_running and not ended.status.is_terminal:
                await cancel_jobs(self.state, [job])
        if ended.status is not JobStatus.SUCCEEDED or ended.result is None:
            raise _failure(ended)
        return completions_response(ended, ended.result)

    async def _chunks(self, job: Job, after: int) -> AsyncGenerator[pb.CompletionChunk, None]:
        """The job's chunks after `after` as messages, the final one with the usage; a job that
        did not succeed ends the stream with its failure's status."""
        ended: Job | None = None
        chunks = self.state.stream_chunks(job.id, after)
        try:
            async for chunk in chunks:
                if chunk.finish_reason in _FAILED_CHUNK:
                    # the job's status tells what happened; only the text is passed on
                    if chunk.text:
                        yield chunk_message(_unfinished(chunk))
                    continue
                usage = None
                if chunk.final:
                    ended = await self.state.wait_job(job.id, FINAL_STATUS_WAIT_S)
                    usage = ended.result.usage if ended.result is not None else None
                yield chunk_message(chunk, usage)
        finally:
            await chunks.aclose()
        if ended is None or not ended.status.is_terminal:
            ended = await self.state.wait_job(job.id, FINAL_STATUS_WAIT_S)
        if ended.status is not JobStatus.SUCCEEDED:
            raise _failure(ended)


def _unfinished(chunk: TokenChunk) -> TokenChunk:
    return chunk.model_copy(update={"finish_reason": None, "stop_reason": None, "final": False})


def _failure(job: Job) -> ApiError:
    error = job_failure(job)
    return ApiError(error.code, error.message, error.param)


def _invalid(param: str, reason: str) -> ApiError:
    return ApiError(ErrorCode.INVALID_REQUEST, f"{param}: {reason}", param)
