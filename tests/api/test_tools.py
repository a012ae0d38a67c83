"""Tool calling on chat completions: what the job asks of the model (tools described, calls
in the history rendered, forced calls constrained) and how its output becomes `tool_calls`,
whole and streamed."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import jsonschema

from producer_api.openai_convert import ChatChunks, chat_body, chat_job
from producer_api.openai_models import ChatCompletionRequest
from schemas import Job, JobStatus, TokenChunk
from schemas.jobs import new_job_id
from schemas.results import ChoiceResult, JobResult, Timings, Usage
from tests.api.conftest import MODEL

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL, messages=fields.pop("messages", ASK), **fields)


def finished_job(req: ChatCompletionRequest, text: str) -> Job:
    job_request = chat_job(req, 16, 30.0)
    result = JobResult(
        choices=[ChoiceResult(index=0, text=text, token_ids=[1], finish_reason="stop")],
        usage=Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4),
        timings=Timings(queued_at=datetime.now(UTC)),
    )
    return Job(
        id=new_job_id(),
        request=job_request,
        status=JobStatus.SUCCEEDED,
        created_at=datetime.now(UTC),
        result=result,
    )


def test_required_constrains_the_output_to_a_call_with_valid_arguments():
    schema = chat_job(request(tools=[WEATHER, TIME], tool_choice="required"), 64, 30.0)
    constraint = schema.sampling.structured_output
    assert constraint is not None and constraint.json_schema is not None
    good = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
    jsonschema.validate(good, constraint.json_schema)
    bad = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "K"}}
    try:
        jsonschema.validate(bad, constraint.json_schema)
        raise AssertionError("an argument outside the function's schema validated")
    except jsonschema.ValidationError:
        pass


def test_a_named_function_allows_only_that_function():
    req = request(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    constraint = chat_job(req, 64, 30.0).sampling.structured_output
    assert constraint is not None and constraint.json_schema is not None
    assert constraint.json_schema["properties"]["name"] == {"const": "get_time"}


def test_tools_are_described_to_the_model_and_history_calls_are_rendered():
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ]
    job = chat_job(request(messages=history, tools=[WEATHER]), 64, 30.0)
    messages = job.messages or []
    assert messages[0].role == "system" and "get_weather" in messages[0].content
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in (
        messages[2].content
    )
    assert messages[3].role == "tool" and "18 C, sunny" in messages[3].content
    assert job.sampling.structured_output is None  # auto: the model decides


def test_tool_choice_none_neither_describes_nor_constrains():
    job = chat_job(request(tools=[WEATHER], tool_choice="none"), 64, 30.0)
    assert job.messages is not None and [m.role for m in job.messages] == ["user"]
    assert job.sampling.structured_output is None


def test_a_forced_call_becomes_tool_calls_with_json_arguments():
    req = request(tools=[WEATHER], tool_choice="required")
    text = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
    choice = chat_body(req, finished_job(req, text))["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}


def test_auto_parses_hermes_tool_calls_out_of_the_text():
    req = request(tools=[WEATHER, TIME])
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    message = chat_body(req, finished_job(req, text))["choices"][0]["message"]
    assert message["content"] == "Let me check."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    plain = chat_body(req, finished_job(req, "It is sunny."))["choices"][0]
    assert plain["message"]["content"] == "It is sunny." and "tool_calls" not in plain["message"]
    assert plain["finish_reason"] == "stop"


def test_streamed_tool_calls_arrive_as_tool_call_deltas():
    req = request(tools=[WEATHER], stream=True)
    job = finished_job(req, "")
    framer = ChatChunks(req, job)
    pieces = ['<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Nice", "unit": "C"}}']
    frames = [
        framer.chunk(0, TokenChunk(job_id=job.id, index=i, choice=0, text=piece))
        for i, piece in enumerate(pieces)
    ]
    frames.append(
        framer.chunk(
            0,
            TokenChunk(job_id=job.id, index=2, choice=0, text="</tool_call>", finish_reason="stop"),
        )
    )
    assert all(not f["choices"][0]["delta"] for f in frames[:-1])
    last = frames[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Nice", "unit": "C"}
