"""The wire contract (`schemas`: jobs, results, chunks, served models) as gRPC messages."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from google.protobuf.timestamp_pb2 import Timestamp

from producer_api.grpc.stubs import inference_pb2 as pb
from producer_api.openai_embeddings import job_vectors
from producer_api.workers import ServedModel
from schemas import ChoiceResult, Job, JobResult, TokenChunk, TokenLogprob, Usage
from schemas.chunks import StopReason


def usage_message(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
    )


def _logprobs(items: Sequence[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=item.token_id,
            logprob=item.logprob,
            token=item.token or "",
            top_logprobs=[
                pb.Logprob(token_id=top.token_id, logprob=top.logprob, token=top.token or "")
                for top in item.top_logprobs
            ],
        )
        for item in items or ()
    ]


def _set_stop_reason(message: pb.Choice | pb.CompletionChunk, reason: StopReason) -> None:
    """Fill the stop_reason oneof: the stop sequence (str) or the stop token (int)."""
    if isinstance(reason, str):
        message.stop_sequence = reason
    elif isinstance(reason, int):
        message.stop_token_id = reason


def choice_message(choice: ChoiceResult) -> pb.Choice:
    message = pb.Choice(
        index=choice.index,
        text=choice.text,
        token_ids=choice.token_ids,
        finish_reason=choice.finish_reason,
        logprobs=_logprobs(choice.logprobs),
    )
    _set_stop_reason(message, choice.stop_reason)
    return message


def prompt_logprobs_messages(result: JobResult) -> list[pb.PromptLogprob]:
    """One message per prompt token (the first's logprob unset) where they were asked for."""
    return [
        pb.PromptLogprob() if item is None else pb.PromptLogprob(logprob=_logprobs([item])[0])
        for item in result.prompt_logprobs or ()
    ]


def completions_response(job: Job, result: JobResult) -> pb.CompletionsResponse:
    return pb.CompletionsResponse(
        job_id=job.id,
        model_id=job.model,
        choices=[choice_message(choice) for choice in result.choices],
        usage=usage_message(result.usage),
        prompt_logprobs=prompt_logprobs_messages(result),
    )


def embedding_response(model: str, jobs: Sequence[Job]) -> pb.EmbeddingResponse:
    """The succeeded embedding jobs of a request's inputs, in input order."""
    data = []
    prompt_tokens = 0
    for job in jobs:
        for vector, count in job_vectors([job]):
            prompt_tokens += count
            data.append(pb.Embedding(index=len(data), embedding=vector, job_id=job.id))
    usage = pb.Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
    return pb.EmbeddingResponse(model_id=model, data=data, usage=usage)


def chunk_message(chunk: TokenChunk, usage: Usage | None = None) -> pb.CompletionChunk:
    message = pb.CompletionChunk(
        job_id=chunk.job_id,
        index=chunk.index,
        choice=chunk.choice,
        text=chunk.text,
        token_ids=chunk.token_ids,
        logprobs=_logprobs(chunk.logprobs),
        finish_reason=chunk.finish_reason or "",
        final=chunk.final,
        usage=None if usage is None else usage_message(usage),
    )
    _set_stop_reason(message, chunk.stop_reason)
    return message


def _timestamp(value: datetime | None) -> Timestamp | None:
    if value is None:
        return None
    stamp = Timestamp()
    stamp.FromDatetime(value)
    return stamp


def job_message(job: Job) -> pb.Job:
    message = pb.Job(
        id=job.id,
        status=job.status.value,
        model_id=job.model,
        priority=job.request.priority,
        attempts=job.attempts,
        worker=job.worker or "",
        created_at=_timestamp(job.created_at),
        started_at=_timestamp(job.started_at),
        finished_at=_timestamp(job.finished_at),
    )
    if job.result is not None:
        message.choices.extend(choice_message(choice) for choice in job.result.choices)
        message.usage.CopyFrom(usage_message(job.result.usage))
        message.embedding.extend(job.result.embedding or ())
        for index, vector in enumerate(job.result.embeddings or ()):
            message.embeddings.append(pb.Embedding(index=index, embedding=vector, job_id=job.id))
        message.prompt_logprobs.extend(prompt_logprobs_messages(job.result))
    if job.error is not None:
        message.error.CopyFrom(
            pb.JobError(
                code=job.error.code.value, message=job.error.message, param=job.error.param or ""
            )
        )
    return message


def model_message(served: ServedModel) -> pb.Model:
    return pb.Model(
        id=served.name,
        max_model_len=served.max_model_len,
        workers=served.workers,
        quantization=served.quantization or "",
        quantizations=[method or "" for method in served.quantizations],
        created=int(served.since),
    )
