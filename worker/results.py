"""A finished engine request -> the JobResult stored in the job hash."""

from __future__ import annotations

from datetime import datetime

from schemas import ChoiceResult, JobResult, Timings, Usage
from worker.chunking import convert_logprobs
from worker.held import HeldJob


def build_result(held: HeldJob, output: object, finished_at: datetime) -> JobResult:
    """`output` is the engine's RequestOutput. Token ids and text cover the whole choice, earlier
    attempts included (the engine re-prefilled them); logprobs of tokens an earlier attempt
    produced come from its published chunks."""
    choices = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        state = held.choices[completion.index]
        logprobs = convert_logprobs(completion.logprobs)
        if logprobs is not None and state.prior_token_ids:
            logprobs = (state.prior_logprobs or []) + logprobs
        if logprobs is not None and len(logprobs) != len(completion.token_ids):
            logprobs = None  # an earlier attempt lost them; better none than misaligned
        choices.append(
            ChoiceResult(
                index=completion.index,
                text=completion.text,
                token_ids=list(completion.token_ids),
                finish_reason=completion.finish_reason or "stop",
                stop_reason=completion.stop_reason,
                logprobs=logprobs,
            )
        )
    prompt_tokens = len(output.prompt_token_ids)
    cached = min(int(getattr(output.metrics, "num_cached_prompt_tokens", 0) or 0), prompt_tokens)
    usage = Usage.of(prompt_tokens, sum(len(c.token_ids) for c in choices), cached)
    timings = Timings.from_times(
        queued_at=held.job.created_at,
        started_at=held.job.started_at or held.started_at,
        first_token_at=held.first_token_at,
        finished_at=finished_at,
    )
    return JobResult(choices=choices, usage=usage, timings=timings)
