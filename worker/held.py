"""What a worker keeps about each job it holds: the stream entry, and per-choice output state."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from schemas import FinishReason, Job, TokenChunk, TokenLogprob
from schemas.batches import BATCH_ID_METADATA


@dataclass(eq=False)
class ChoiceState:
    """One choice's output: what earlier attempts published, and what is not published yet."""

    index: int
    prior_token_ids: list[int] = field(default_factory=list)  # published by an earlier attempt
    prior_logprobs: list[TokenLogprob] | None = None
    pending_token_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list[TokenLogprob] | None = None
    pending_since: float | None = None  # monotonic time of the oldest unpublished token
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    finish_published: bool = False
    # produced in this run and not yet folded into prior_token_ids (see HeldJob.fold_run_output)
    run_token_ids: list[int] = field(default_factory=list)
    run_logprobs: list[TokenLogprob] | None = None

    @property
    def has_pending(self) -> bool:
        return bool(self.pending_token_ids or self.pending_text) or (
            self.finish_reason is not None and not self.finish_published
        )


@dataclass(eq=False)
class HeldJob:
    """A job this worker pulled: from read through engine run to result (or hand-back)."""

    job: Job
    entry_id: str
    choices: list[ChoiceState]
    next_index: int = 0  # number of the next chunk to publish
    resumed: bool = False  # earlier attempts published chunks
    started_at: datetime | None = None
    first_token_at: datetime | None = None
    prompt_len: int = 0
    start_confirmed: bool = False  # our transition to running was applied
    ttl_set: bool = False  # this attempt has set its replay stream's TTL
    queue_stream: str = ""  # the stream the entry came from ("": the worker's jobs stream)
    crash_resumes: int = 0  # stored with this run's start (see worker.crashes)
    quarantined: bool = False  # suspected of a worker's death: runs as the only newcomer
    progressed: bool = False  # the engine produced output for it in this run
    prompt_ids: list[int] | None = None  # as the engine was given them
    input_ids: list[list[int]] | None = None  # a job of several inputs: each, as given them
    token_type_ids: list[int] | None = None  # a text pair's segments, as the engine got them
    in_engine: bool = False  # False while it waits out of the engine after a failed step

    @property
    def job_id(self) -> str:
        return self.job.id

    @property
    def stream(self) -> bool:
        return self.job.request.stream

    @property
    def batch_id(self) -> str | None:
        """The Batch API batch this job runs a line of, if any."""
        return self.job.request.metadata.get(BATCH_ID_METADATA) or None

    @property
    def all_finished(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)

    @property
    def prior_output_token_ids(self) -> list[list[int]] | None:
        if not any(choice.prior_token_ids for choice in self.choices):
            return None
        return [list(choice.prior_token_ids) for choice in self.choices]

    def fold_run_output(self) -> None:
        """Count what this run produced as output to rejoin the engine from (it left the engine
        after a failed step): the engine re-prefills it, like a crash resume's published
        chunks. What is not published yet stays pending."""
        for choice in self.choices:
            choice.prior_token_ids.extend(choice.run_token_ids)
            if choice.run_logprobs is not None:
                choice.prior_logprobs = (choice.prior_logprobs or []) + choice.run_logprobs
            choice.run_token_ids = []
            choice.run_logprobs = None

    @classmethod
    def fresh(cls, job: Job, entry_id: str, stream: str = "") -> HeldJob:
        n = job.request.sampling.n
        choices = [ChoiceState(i) for i in range(n)]
        return cls(
            job=job,
            entry_id=entry_id,
            choices=choices,
            queue_stream=stream,
            crash_resumes=job.crash_resumes,
        )

    def resume_from(self, chunks: list[TokenChunk]) -> None:
        """Continue after the chunks earlier attempts published (in index order)."""
        for chunk in chunks:
            if chunk.index < self.next_index or chunk.choice >= len(self.choices):
                continue
            choice = self.choices[chunk.choice]
            choice.prior_token_ids.extend(chunk.token_ids)
            if chunk.logprobs is not None:
                choice.prior_logprobs = (choice.prior_logprobs or []) + list(chunk.logprobs)
            if chunk.finish_reason is not None:
                choice.finish_reason = chunk.finish_reason
                choice.stop_reason = chunk.stop_reason
                choice.finish_published = True
            self.next_index = chunk.index + 1
        self.resumed = self.next_index > 0
