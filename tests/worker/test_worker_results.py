"""job_result: an engine RequestOutput -> the wire JobResult (the worker's and the batch CLI's)."""

from __future__ import annotations

from datetime import UTC, datetime

from engine import outputs
from schemas import Timings
from schemas import TokenLogprob as WireLogprob
from worker.held import ChoiceState
from worker.results import job_result

T0 = datetime(2024, 1, 1, tzinfo=UTC)
TIMINGS = Timings.from_times(T0, T0, T0, T0)


def output(*choices: outputs.CompletionOutput, cached: int = 0) -> outputs.RequestOutput:
    metrics = outputs.RequestMetrics(arrival_time=0.0, num_cached_prompt_tokens=cached)
    return outputs.RequestOutput("r", None, [1, 2, 3], list(choices), metrics, finished=True)


def logprobs(*token_ids: int) -> list[outputs.TokenLogprob]:
    return [outputs.TokenLogprob(t, -0.5, [(t, -0.5), (9, -2.0)]) for t in token_ids]


def test_choices_in_index_order_with_usage_and_logprobs():
    result = job_result(
        output(
            outputs.CompletionOutput(1, "b", [7], "length", logprobs=logprobs(7)),
            outputs.CompletionOutput(0, "a", [5, 6], None, stop_reason="x"),
            cached=2,
        ),
        TIMINGS,
    )
    assert [(c.index, c.text, c.token_ids) for c in result.choices] == [
        (0, "a", [5, 6]),
        (1, "b", [7]),
    ]
    assert [c.finish_reason for c in result.choices] == ["stop", "length"]
    assert result.choices[0].stop_reason == "x" and result.choices[0].logprobs is None
    [lp] = result.choices[1].logprobs or []
    assert (lp.token_id, lp.logprob, [t.token_id for t in lp.top_logprobs]) == (7, -0.5, [7, 9])
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 3)
    assert result.usage.cached_prompt_tokens == 2
    assert result.timings == TIMINGS


def test_logprobs_of_an_earlier_attempt_come_first_or_none_when_lost():
    earlier = ChoiceState(
        0, prior_token_ids=[5], prior_logprobs=[WireLogprob(token_id=5, logprob=-1.0)]
    )
    resumed = output(outputs.CompletionOutput(0, "ab", [5, 6], "stop", logprobs=logprobs(6)))
    [choice] = job_result(resumed, TIMINGS, [earlier]).choices
    assert [(lp.token_id, lp.logprob) for lp in choice.logprobs or []] == [(5, -1.0), (6, -0.5)]

    lost = ChoiceState(0, prior_token_ids=[5])  # the earlier attempt published no logprobs
    [choice] = job_result(resumed, TIMINGS, [lost]).choices
    assert choice.logprobs is None


def test_logprobs_carry_the_engines_token_texts():
    decoded = outputs.TokenLogprob(7, -0.5, [(7, -0.5), (9, -2.0)], {7: " the", 9: " a"})
    undecoded = outputs.TokenLogprob(8, -0.1, [(8, -0.1)])  # a model without a tokenizer
    result = job_result(
        output(
            outputs.CompletionOutput(0, " the", [7, 8], "length", logprobs=[decoded, undecoded])
        ),
        TIMINGS,
    )
    first, second = result.choices[0].logprobs or []
    assert first.token == " the"
    assert [(t.token_id, t.token) for t in first.top_logprobs] == [(7, " the"), (9, " a")]
    assert second.token is None and second.top_logprobs[0].token is None


def test_prompt_logprobs_reach_the_result_with_the_first_token_unscored():
    out = output(outputs.CompletionOutput(0, "a", [5], "stop"))
    assert job_result(out, TIMINGS).prompt_logprobs is None
    out.prompt_logprobs = [None, *logprobs(2, 3)]
    scored = job_result(out, TIMINGS).prompt_logprobs
    assert scored is not None and scored[0] is None
    assert [(lp.token_id, lp.logprob) for lp in scored[1:] if lp is not None] == [
        (2, -0.5),
        (3, -0.5),
    ]
