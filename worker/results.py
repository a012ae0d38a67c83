"""A finished engine request -> the JobResult stored in the job hash (or written to a batch
output line)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.outputs import CompletionOutput, RequestOutput
from schemas import ChoiceResult, JobResult, Timings, Usage
from worker.chunking import convert_logprobs
from worker.held import ChoiceState


def job_result(
    output: RequestOutput, timings: Timings, earlier: Sequence[ChoiceState] = ()
) -> JobResult:
    """The wire result of `output`. Token ids and text cover each whole choice, earlier attempts
    included (the engine re-prefilled them); logprobs of the tokens an earlier attempt produced
    come from the chunks it published (`earlier`: the job's choice states, by index)."""
    ordered = sorted(output.outputs, key=lambda c: c.index)
    choices = [
        _choice_result(c, earlier[c.index] if earlier else ChoiceState(c.index)) for c in ordered
    ]
    counts = output.input_token_counts
    prompt_tokens = len(output.prompt_token_ids) if counts is None else sum(counts)
    cached = min(output.metrics.num_cached_prompt_tokens, prompt_tokens)
    usage = Usage.of(prompt_tokens, sum(len(c.token_ids) for c in choices), cached)
    prompt_logprobs = None
    if output.prompt_logprobs is not None:
        prompt_logprobs = [
            None if item is None else convert_logprobs([item])[0] for item in output.prompt_logprobs
        ]
    return JobResult(
        choices=choices,
        usage=usage,
        timings=timings,
        prompt_logprobs=prompt_logprobs,
        embedding=output.embedding,
        embeddings=output.embeddings,
        input_tokens=counts,
    )


def _choice_result(completion: CompletionOutput, earlier: ChoiceState) -> ChoiceResult:
    logprobs = convert_logprobs(completion.logprobs)
    if logprobs is not None and earlier.prior_token_ids:
        logprobs = (earlier.prior_logprobs or []) + logprobs
    if logprobs is not None and len(logprobs) != len(completion.token_ids):
        logprobs = None  # an earlier attempt lost them; better none than misaligned
    return ChoiceResult(
        index=completion.index,
        text=completion.text,
        token_ids=list(completion.token_ids),
        finish_reason=completion.finish_reason or "stop",
        stop_reason=completion.stop_reason,
        logprobs=logprobs,
    )
