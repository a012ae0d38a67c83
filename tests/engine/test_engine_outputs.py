"""The engine's one output route: the delta that finishes a request carries its whole output,
also for requests resumed from an earlier attempt's tokens."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.engine import Engine
from engine.model_files import DEFAULT_MODEL
from engine.outputs import EngineRequest, RequestDelta, RequestOutput

pytestmark = pytest.mark.model

PROMPT = "Name three colours of the rainbow:"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32 whatever `auto` picks on this CPU: a resumed request prefills its earlier tokens
    # where the uninterrupted one decoded them, and only in float32 do the two kernels agree
    # to the token (in bf16 their roundings differ and can flip a near-tie, as they do on
    # AVX512-BF16 machines).
    return LLM(DEFAULT_MODEL, max_model_len=256, dtype="float32")


def run(engine: Engine, request: EngineRequest) -> tuple[list[RequestDelta], RequestOutput]:
    engine.add_request(request)
    deltas: list[RequestDelta] = []
    while engine.has_unfinished():
        deltas += engine.step()
    carrying = [d for d in deltas if d.output is not None]
    assert len(carrying) == 1 and carrying[0] is deltas[-1]
    assert [d for d in deltas if d.request_finished] == carrying
    output = carrying[0].output
    assert output is not None and output.finished
    return deltas, output


def test_the_finishing_delta_carries_the_whole_output(llm: LLM) -> None:
    deltas, output = run(llm.engine, EngineRequest("whole", PROMPT, GREEDY))
    for choice in output.outputs:
        mine = [d for d in deltas if d.choice_index == choice.index]
        assert [t for d in mine for t in d.token_ids] == choice.token_ids
        assert "".join(d.text for d in mine) == choice.text
        assert choice.finish_reason == "length" == mine[-1].finish_reason
    [offline] = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert [c.token_ids for c in offline.outputs] == [c.token_ids for c in output.outputs]


@pytest.mark.parametrize("done", [3, GREEDY.max_tokens])
def test_a_resumed_request_ends_like_an_uninterrupted_one(llm: LLM, done: int) -> None:
    """`done` == max_tokens: every choice was complete on arrival; one delta still carries it."""
    _, whole = run(llm.engine, EngineRequest("first", PROMPT, GREEDY))
    prior = [c.token_ids[:done] for c in whole.outputs]
    resumed = EngineRequest("again", PROMPT, GREEDY, prior_output_token_ids=prior)
    _, output = run(llm.engine, resumed)
    assert [(c.token_ids, c.text, c.finish_reason) for c in output.outputs] == [
        (c.token_ids, c.text, c.finish_reason) for c in whole.outputs
    ]
