"""Structured output and tool calls against the real system (uvicorn, Redis, `inferq worker` on
the default model), driven by the official `openai` client."""

from __future__ import annotations

import json
from typing import Annotated

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.api.test_real_worker import MODEL, sdk, system  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.model]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    languages: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS},
}
ASK = [{"role": "user", "content": "Describe a programmer as JSON."}]


def test_parse_returns_a_parsed_pydantic_object(sdk):  # noqa: F811
    completion = sdk.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Person, max_tokens=200, temperature=1.0, seed=1
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person)
    assert completion.choices[0].finish_reason == "stop"


def test_streaming_returns_the_same_content(sdk):  # noqa: F811
    fields = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=120,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": Person.model_json_schema()},
        },
    )
    whole = sdk.chat.completions.create(**fields).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in sdk.chat.completions.create(**fields, stream=True)
        if c.choices
    )
    assert streamed == whole
    Person.model_validate_json(whole)


def test_required_tool_choice_returns_a_call_whose_arguments_validate(sdk):  # noqa: F811
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    for stream in (False, True):
        fields = dict(
            model=MODEL,
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=80,
            temperature=1.0,
        )
        if stream:  # the client adds the call's deltas up, as applications do
            with sdk.chat.completions.stream(**fields) as events:
                choice = events.get_final_completion().choices[0]
            calls, reason = choice.message.tool_calls or [], choice.finish_reason
        else:
            choice = sdk.chat.completions.create(**fields).choices[0]
            calls, reason = choice.message.tool_calls or [], choice.finish_reason
        assert reason == "tool_calls"
        (call,) = calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_streamed_forced_call_streams_the_arguments_of_the_whole_response(sdk, tool_choice):  # noqa: F811
    fields = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice=tool_choice,
        max_tokens=80,
        temperature=0,
    )
    (whole,) = sdk.chat.completions.create(**fields).choices[0].message.tool_calls
    chunks = [c for c in sdk.chat.completions.create(**fields, stream=True) if c.choices]
    entries = [e for c in chunks for e in c.choices[0].delta.tool_calls or []]
    assert entries[0].id is not None and entries[0].function.name == "get_weather"
    fragments = [e.function.arguments for e in entries if e.function.arguments]
    assert len(fragments) > 1  # streamed as generated, not in one piece at the end
    assert "".join(fragments) == whole.function.arguments
    jsonschema.validate(json.loads(whole.function.arguments), WEATHER_PARAMETERS)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_choice_and_regex_through_the_vllm_extras(sdk):  # noqa: F811
    labels = ["positive", "negative"]
    response = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "I love it. Sentiment?"}],
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": labels}},
    )
    assert response.choices[0].message.content in labels
    completion = sdk.completions.create(
        model=MODEL,
        prompt="Phone:",
        max_tokens=20,
        extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"},
    )
    assert len(completion.choices[0].text) == 8 and completion.choices[0].text[3] == "-"


def test_a_grammar_that_does_not_parse_is_refused_with_where_it_goes_wrong(sdk):  # noqa: F811
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            extra_body={"guided_grammar": 'root ::= "a" |'},
        )
    assert caught.value.body["param"] == "guided_grammar"
    assert "invalid EBNF grammar at line 1, column 15" in caught.value.message


def test_an_impossible_constraint_ends_with_length_not_a_hang(sdk):  # noqa: F811
    response = sdk.completions.create(
        model=MODEL, prompt="Say a:", max_tokens=4, extra_body={"guided_regex": "a{40}"}
    )
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].text == "a" * len(response.choices[0].text)
