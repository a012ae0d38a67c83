"""Chunk numbering, coalescing and resumption, on the worker's pure bookkeeping."""

from __future__ import annotations

from engine.outputs import RequestDelta
from schemas import Job, JobRequest
from worker.chunking import ChunkPolicy, absorb, take_chunks
from worker.held import HeldJob


def _held(n: int = 1, stream: bool = True) -> HeldJob:
    request = JobRequest(model="m", prompt="x", stream=stream, sampling={"n": n, "max_tokens": 9})
    return HeldJob.fresh(Job.new(request), "1-0")


def _delta(held: HeldJob, choice: int, token: int, finish: str | None = None) -> RequestDelta:
    return RequestDelta(held.job_id, choice, [token], f"<{token}>", finish_reason=finish)


def test_interval_coalescing_waits_for_time_or_finish():
    held, policy = _held(), ChunkPolicy(tokens=100, interval_s=0.5)
    absorb(held, _delta(held, 0, 1), now=10.0)
    absorb(held, _delta(held, 0, 2), now=10.2)
    assert take_chunks(held, policy, now=10.3) == []
    [chunk] = take_chunks(held, policy, now=10.5)  # the oldest token waited 0.5 s
    assert (chunk.index, chunk.token_ids, chunk.text, chunk.final) == (0, [1, 2], "<1><2>", False)
    absorb(held, _delta(held, 0, 3, finish="length"), now=10.6)
    [last] = take_chunks(held, policy, now=10.6)  # a finish never waits
    assert (last.index, last.token_ids, last.finish_reason, last.final) == (1, [3], "length", True)
    assert take_chunks(held, policy, now=20.0) == []


def test_choices_share_one_numbering_and_only_the_last_finish_is_final():
    held, policy = _held(n=2), ChunkPolicy()
    absorb(held, _delta(held, 0, 5, finish="stop"), now=0)
    absorb(held, _delta(held, 1, 6), now=0)
    first = take_chunks(held, policy, now=0)
    assert [(c.index, c.choice, c.finish_reason, c.final) for c in first] == [
        (0, 0, "stop", False),
        (1, 1, None, False),
    ]
    absorb(held, _delta(held, 1, 7, finish="length"), now=1)
    [last] = take_chunks(held, policy, now=1)
    assert (last.index, last.choice, last.final) == (2, 1, True)


def test_unstreamed_jobs_publish_at_the_end_or_when_forced():
    held, policy = _held(stream=False), ChunkPolicy()
    absorb(held, _delta(held, 0, 1), now=0)
    assert take_chunks(held, policy, now=5) == []
    [forced] = take_chunks(held, policy, now=5, force=True)  # hand-back keeps the progress
    assert (forced.index, forced.token_ids, forced.final) == (0, [1], False)


def test_resuming_continues_after_published_chunks():
    first = _held(n=2)
    absorb(first, _delta(first, 0, 1), now=0)
    absorb(first, _delta(first, 1, 2), now=0)
    absorb(first, _delta(first, 0, 3, finish="stop"), now=0)
    published = take_chunks(first, ChunkPolicy(), now=0)
    again = HeldJob.fresh(first.job, "2-0")
    again.resume_from(published)
    assert again.next_index == 2 and again.resumed
    assert again.prior_output_token_ids == [[1, 3], [2]]
    assert again.choices[0].finish_published and not again.choices[1].finish_published


def test_the_first_chunk_carries_the_prompt_length_for_running_usage():
    held, policy = _held(), ChunkPolicy()
    held.prompt_len = 11
    absorb(held, _delta(held, 0, 1), now=0)
    [first] = take_chunks(held, policy, now=0)
    absorb(held, _delta(held, 0, 2, finish="stop"), now=1)
    [last] = take_chunks(held, policy, now=1)
    assert (first.prompt_tokens, last.prompt_tokens) == (11, None)
