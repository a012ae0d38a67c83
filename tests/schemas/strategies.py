"""Hypothesis strategies producing valid wire objects (jobs, chunks, results)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from hypothesis import strategies as st

from schemas import (
    ChoiceResult,
    ErrorBody,
    ErrorCode,
    Job,
    JobRequest,
    JobResult,
    JobStatus,
    SamplingParams,
    Timings,
    TokenChunk,
    TokenLogprob,
    Usage,
    new_job_id,
)
from schemas.jobs import MAX_PRIORITY

# printable, no whitespace/control: what names and keys allow
names = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Zs", "Zl", "Zp")).filter(
        lambda c: not c.isspace()
    ),
    min_size=1,
    max_size=40,
)
token_ids = st.integers(min_value=0, max_value=200_000)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
logprob_values = st.floats(min_value=-50.0, max_value=0.0, allow_nan=False)

aware_datetimes = st.datetimes(
    min_value=datetime(2000, 1, 1),
    max_value=datetime(2100, 1, 1),
    timezones=st.sampled_from(
        [UTC, timezone(timedelta(hours=5, minutes=30)), timezone(-timedelta(hours=8))]
    ),
)


@st.composite
def sampling_params(draw) -> SamplingParams:
    logprobs = draw(st.booleans())
    max_tokens = draw(st.integers(1, 4096))
    return SamplingParams(
        n=draw(st.integers(1, 4)),
        temperature=draw(st.floats(0.0, 2.0)),
        top_p=draw(st.floats(0.01, 1.0)),
        top_k=draw(st.one_of(st.just(-1), st.integers(1, 100))),
        min_p=draw(st.floats(0.0, 1.0)),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        repetition_penalty=draw(st.floats(0.01, 2.0)),
        seed=draw(st.none() | st.integers(0, 2**63 - 1)),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        stop=draw(st.lists(st.text(min_size=1, max_size=8), max_size=4)),
        stop_token_ids=draw(st.lists(token_ids, max_size=4)),
        ignore_eos=draw(st.booleans()),
        logprobs=logprobs,
        top_logprobs=draw(st.integers(0, 20)) if logprobs else 0,
        skip_special_tokens=draw(st.booleans()),
    )


chat_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool"]),
            "content": st.text(max_size=50),
        },
        optional={"name": names},
    ),
    min_size=1,
    max_size=4,
)


@st.composite
def job_requests(draw) -> JobRequest:
    kind = draw(st.sampled_from(["prompt", "messages", "prompt_token_ids"]))
    inputs = {
        "prompt": st.text(min_size=1, max_size=80),
        "messages": chat_messages,
        "prompt_token_ids": st.lists(token_ids, min_size=1, max_size=30),
    }
    fields = {
        "model": draw(names),
        kind: draw(inputs[kind]),
        "sampling": draw(sampling_params()),
        "stream": draw(st.booleans()),
        "priority": draw(st.integers(0, MAX_PRIORITY)),
        "idempotency_key": draw(st.none() | names),
        "metadata": draw(
            st.dictionaries(st.text(min_size=1, max_size=10), st.text(max_size=20), max_size=4)
        ),
    }
    timing = draw(st.sampled_from(["none", "deadline", "timeout"]))
    if timing == "deadline":
        fields["deadline"] = draw(aware_datetimes)
    elif timing == "timeout":
        fields["timeout_s"] = draw(st.floats(0.001, 3600.0))
    return JobRequest(**fields)


@st.composite
def token_logprobs(draw) -> TokenLogprob:
    return TokenLogprob(
        token_id=draw(token_ids),
        logprob=draw(logprob_values),
        token=draw(st.none() | st.text(max_size=5)),
        top_logprobs=draw(
            st.lists(
                st.builds(
                    dict,
                    token_id=token_ids,
                    logprob=logprob_values,
                    token=st.none() | st.text(max_size=5),
                ),
                max_size=3,
            )
        ),
    )


finish_reasons = st.sampled_from(["stop", "length", "abort", "error"])
stop_reasons = st.none() | st.text(min_size=1, max_size=5) | token_ids


@st.composite
def token_chunks(draw) -> TokenChunk:
    ids = draw(st.lists(token_ids, max_size=4))
    with_logprobs = draw(st.booleans())
    final = draw(st.booleans())
    finish = draw(finish_reasons) if final else draw(st.none() | finish_reasons)
    return TokenChunk(
        job_id=new_job_id(),
        index=draw(st.integers(0, 10**6)),
        choice=draw(st.integers(0, 15)),
        text=draw(st.text(max_size=20)),
        token_ids=ids,
        logprobs=[draw(token_logprobs()) for _ in ids] if with_logprobs else None,
        finish_reason=finish,
        stop_reason=draw(stop_reasons) if finish is not None else None,
        final=final,
    )


@st.composite
def choice_results(draw, index: int) -> ChoiceResult:
    ids = draw(st.lists(token_ids, max_size=6))
    with_logprobs = draw(st.booleans())
    return ChoiceResult(
        index=index,
        text=draw(st.text(max_size=40)),
        token_ids=ids,
        finish_reason=draw(finish_reasons),
        stop_reason=draw(stop_reasons),
        logprobs=[draw(token_logprobs()) for _ in ids] if with_logprobs else None,
    )


@st.composite
def timings(draw) -> Timings:
    queued = draw(aware_datetimes)
    steps = draw(st.lists(st.floats(0.0, 100.0), min_size=3, max_size=3))
    started = queued + timedelta(seconds=steps[0])
    first = started + timedelta(seconds=steps[1])
    finished = first + timedelta(seconds=steps[2])
    upto = draw(st.integers(0, 3))
    instants = [started, first, finished][:upto] + [None] * (3 - upto)
    return Timings.from_times(queued, *instants)


@st.composite
def job_results(draw) -> JobResult:
    n = draw(st.integers(1, 3))
    choices = [draw(choice_results(i)) for i in range(n)]
    prompt_tokens = draw(st.integers(0, 10_000))
    usage = Usage.of(
        prompt_tokens,
        sum(len(c.token_ids) for c in choices),
        draw(st.integers(0, prompt_tokens)),
    )
    return JobResult(choices=choices, usage=usage, timings=draw(timings()))


@st.composite
def jobs(draw) -> Job:
    return Job(
        id=new_job_id(),
        request=draw(job_requests()),
        status=draw(st.sampled_from(list(JobStatus))),
        owner=draw(st.none() | names),
        created_at=draw(aware_datetimes),
        started_at=draw(st.none() | aware_datetimes),
        finished_at=draw(st.none() | aware_datetimes),
        attempts=draw(st.integers(0, 10)),
        worker=draw(st.none() | names),
        entry_id=draw(st.none() | st.from_regex(r"\A[0-9]{1,13}-[0-9]{1,3}\Z")),
        error=draw(st.none() | error_bodies),
        result=draw(st.none() | job_results()),
    )


error_bodies = st.builds(
    ErrorBody.of, st.sampled_from(list(ErrorCode)), st.text(max_size=30), st.none() | names
)
