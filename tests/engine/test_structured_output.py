"""Constrained decoding on the default model: sampled outputs at temperature 1.0 parse and
validate against their constraint; impossible constraints end with "length", bad ones are
refused at add_request, and a request waiting for its grammar does not stall the others."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.errors import RequestRejectedError
from engine.model_files import DEFAULT_MODEL
from engine.outputs import EngineRequest
from schemas.structured import StructuredOutput
from tests.engine.structured_cases import SCHEMAS

pytestmark = pytest.mark.model

SAMPLES = 5
CHAT = [{"role": "user", "content": "Reply with a JSON object describing something."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEFAULT_MODEL, max_model_len=512)


def constrained(max_tokens: int = 200, seed: int | None = None, **constraint) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        max_tokens=max_tokens,
        seed=seed,
        structured_output=StructuredOutput(**constraint),
    )


def _texts(llm: LLM, params: list[SamplingParams]) -> list[tuple[str, str | None]]:
    outputs = llm.chat([CHAT] * len(params), params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]


@pytest.mark.slow
def test_sampled_json_validates_against_every_schema(llm: LLM) -> None:
    params = [
        constrained(json_schema=schema, seed=index * SAMPLES + sample)
        for index, schema in enumerate(SCHEMAS)
        for sample in range(SAMPLES)
    ]
    results = _texts(llm, params)
    failures = []
    for position, (text, reason) in enumerate(results):
        schema = SCHEMAS[position // SAMPLES]
        try:
            jsonschema.validate(json.loads(text), schema)
            assert reason == "stop"
        except (ValueError, AssertionError, jsonschema.ValidationError) as exc:
            failures.append((position // SAMPLES, text, reason, str(exc)[:200]))
    assert not failures, f"{len(failures)}/{len(results)} invalid: {failures[:3]}"


def test_sampled_json_validates_for_a_few_schemas(llm: LLM) -> None:
    schemas = [SCHEMAS[1], SCHEMAS[4], SCHEMAS[15]]
    params = [constrained(json_schema=s, seed=seed) for s in schemas for seed in range(2)]
    for position, (text, reason) in enumerate(_texts(llm, params)):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schemas[position // 2])


def test_any_json_object(llm: LLM) -> None:
    # Nothing bounds an arbitrary object's length: at temperature 1.0 this model runs a fifth
    # to a third of its samples (fp32 / bf16) past 200 tokens inside one string. Those end
    # with "length", cut off inside an object; every sample that ends on its own is one.
    params = [constrained(json_object=True, seed=s) for s in range(8)]
    results = _texts(llm, params)
    finished = [text for text, reason in results if reason == "stop"]
    assert len(finished) >= 2, results
    for text in finished:
        assert isinstance(json.loads(text), dict)
    for text, reason in results:
        assert reason in ("stop", "length") and text.lstrip().startswith("{"), text


def test_regex_and_choice_hold_for_every_sample(llm: LLM) -> None:
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9])?"
    choices = ["positive", "negative", "neutral"]
    params = [constrained(regex=pattern, max_tokens=40, seed=s) for s in range(5)]
    params += [constrained(choice=choices, max_tokens=10, seed=s) for s in range(5)]
    results = _texts(llm, params)
    for text, reason in results[:5]:
        assert reason == "stop" and re.fullmatch(pattern, text), text
    for text, reason in results[5:]:
        assert reason == "stop" and text in choices, text


def test_ebnf_grammar(llm: LLM) -> None:
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    for text, reason in _texts(llm, [constrained(grammar=grammar, max_tokens=30, seed=1)]):
        assert reason == "stop" and re.fullmatch(r"\([0-9](\+[0-9])*\)", text), text


def test_a_constraint_that_needs_more_tokens_ends_with_length(llm: LLM) -> None:
    (text, reason), = _texts(llm, [constrained(regex="a{50}", max_tokens=5)])  # fmt: skip
    assert reason == "length"
    assert re.fullmatch("a*", text)


@pytest.mark.parametrize(
    "constraint",
    [{"grammar": 'root ::= "a" |'}, {"json_schema": {"type": "object", "x-bad": 1, "properties": {"a": {"$ref": "#/nope"}}}}],
)  # fmt: skip
def test_a_constraint_the_grammar_library_refuses_is_rejected_on_arrival(
    llm: LLM, constraint: dict
) -> None:
    # The schema refuses these grammars already; built unchecked, they stand for one the
    # schema's syntax check would let through, which the engine must still refuse itself.
    params = SamplingParams(
        max_tokens=4, structured_output=StructuredOutput.model_construct(**constraint)
    )
    with pytest.raises(RequestRejectedError, match="structured_output"):
        llm.engine.add_request(EngineRequest("bad", "hi", params))
    assert not llm.engine.has_unfinished()


def test_unconstrained_requests_run_while_a_grammar_compiles(llm: LLM) -> None:
    engine = llm.engine
    keys = [f"k{i}" for i in range(40)]
    schema = {
        "type": "object",
        "properties": {k: {"type": "integer"} for k in keys},
        "required": keys,
    }
    engine.add_request(EngineRequest("free", "Count: 1, 2,", SamplingParams(max_tokens=3)))
    engine.add_request(
        EngineRequest("json", "JSON:", constrained(json_schema=schema, max_tokens=3))
    )
    finished: dict[str, str | None] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.output is not None:
                finished[delta.request_id] = delta.output.outputs[0].finish_reason
    assert finished == {"free": "length", "json": "length"}


def test_logit_bias_moves_the_choice(llm: LLM) -> None:
    favourite = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    greedy = SamplingParams(temperature=0, max_tokens=1)
    banned = llm.generate(["The colour of the sky is"], greedy, use_tqdm=False)
    first = banned[0].outputs[0].token_ids[0]
    params = SamplingParams(
        temperature=0,
        max_tokens=3,
        ignore_eos=True,
        logit_bias={favourite: 100.0},
    )
    (biased,) = llm.generate(["The colour of the sky is"], params, use_tqdm=False)
    assert biased.outputs[0].token_ids == [favourite] * 3
    away = SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100.0})
    (moved,) = llm.generate(["The colour of the sky is"], away, use_tqdm=False)
    assert moved.outputs[0].token_ids[0] != first


def test_every_choice_of_n_and_a_resumed_request_keep_to_the_grammar(llm: LLM) -> None:
    schema = SCHEMAS[8]
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=60,
        structured_output=StructuredOutput(json_schema=schema),
    )
    (output,) = llm.generate(["Make a JSON record:"], params, use_tqdm=False)
    assert len(output.outputs) == 3
    for choice in output.outputs:
        jsonschema.validate(json.loads(choice.text), schema)
    # A worker taking over replays the tokens an earlier attempt produced, then goes on.
    done = output.outputs[0].token_ids
    single = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=60,
        structured_output=StructuredOutput(json_schema=schema),
    )
    engine = llm.engine
    engine.add_request(
        EngineRequest("resumed", "Make a JSON record:", single, prior_output_token_ids=[done[:4]])
    )
    resumed = None
    while engine.has_unfinished():
        for delta in engine.step():
            resumed = delta.output or resumed
    assert resumed is not None
    jsonschema.validate(json.loads(resumed.outputs[0].text), schema)


def test_a_grammar_that_fails_to_compile_ends_its_request_with_error(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.structured.grammars import GrammarCache

    def broken(self: GrammarCache, grammar: object) -> None:
        raise RuntimeError("out of memory while compiling")

    monkeypatch.setattr(GrammarCache, "_compile", broken)
    params = constrained(regex="never-compiled-[0-9]{7}", max_tokens=8).model_copy(update={"n": 2})
    engine = llm.engine
    engine.add_request(EngineRequest("broken", "hi", params))
    engine.add_request(EngineRequest("fine", "hi", SamplingParams(max_tokens=2)))
    outputs = {}
    for _ in range(50):
        for delta in engine.step():
            if delta.output is not None:
                outputs[delta.request_id] = [c.finish_reason for c in delta.output.outputs]
        if not engine.has_unfinished():
            break
    assert outputs == {"broken": ["error", "error"], "fine": ["length"]}


def test_a_complete_output_with_ignore_eos_stays_complete_until_length(llm: LLM) -> None:
    params = constrained(choice=["yes", "no"], max_tokens=6).model_copy(update={"ignore_eos": True})
    (text, reason), = _texts(llm, [params])  # fmt: skip
    assert reason == "length" and text in ("yes", "no")


def test_constrained_requests_keep_to_their_grammar_beside_speculating_ones() -> None:
    """A speculating engine: the constrained request is never drafted for and still matches its
    pattern; the repetitive greedy request beside it speculates and keeps its greedy output."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}
    # fp32: in bf16 a verify step (several query rows per sequence) and a decode step round
    # differently, so greedy outputs agree only up to bf16 noise.
    plain, speculating = (
        LLM(DEFAULT_MODEL, max_model_len=512, dtype="float32", speculative_config=config)
        for config in (None, spec)
    )
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    repeat = "Repeat exactly: one two three four five six seven eight. " * 3
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    params = [constrained(regex=pattern, max_tokens=30, seed=s) for s in range(3)]
    prompts = [CHAT[0]["content"]] * 3 + [repeat]
    outputs = speculating.generate(prompts, [*params, greedy])
    reference = plain.generate(prompts, [*params, greedy])
    for output, expected in zip(outputs[:3], reference[:3], strict=True):
        assert re.fullmatch(pattern, output.outputs[0].text), output.outputs[0].text
        assert output.outputs[0].text == expected.outputs[0].text  # seeded: the same draw
    assert outputs[3].outputs[0].token_ids == reference[3].outputs[0].token_ids
    assert speculating.engine.stats().spec_num_draft_tokens > 0
