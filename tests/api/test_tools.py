"""Tool calling on chat completions: what the job asks of the model (tools described, calls
in the history rendered, forced calls constrained) and how its output becomes `tool_calls`,
whole and streamed."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import jsonschema

from producer_api.openai_chunks import ChatChunks
from producer_api.openai_jobs import chat_job
from producer_api.openai_models import ChatCompletionRequest
from producer_api.openai_responses import chat_body
from schemas import Job, JobStatus, TokenChunk
from schemas.jobs import new_job_id
from schemas.results import ChoiceResult, JobResult, Timings, Usage
from tests.api.conftest import ALICE_KEY, MODEL

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


def stream_frames(req: ChatCompletionRequest, job: Job, pieces: list[str]) -> list[dict[str, Any]]:
    """The frames a stream of `pieces` makes (frames with nothing to say are not sent)."""
    framer = ChatChunks(req, job)
    frames = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunk = TokenChunk(
            job_id=job.id, index=i, choice=0, text=piece, finish_reason="stop" if last else None
        )
        frame = framer.chunk(0, chunk)
        if frame is not None:
            frames.append(frame)
    return frames


def assembled(frames: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, tool calls, finish reason) as a client adds them up from the deltas."""
    content, calls = "", {}
    for frame in frames:
        delta = frame["choices"][0]["delta"]
        content += delta.get("content") or ""
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"function": {"arguments": ""}})
            for key in ("id", "type"):
                if key in entry:
                    call[key] = entry[key]
            if "name" in entry["function"]:
                call["function"]["name"] = entry["function"]["name"]
            call["function"]["arguments"] += entry["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], frames[-1]["choices"][0]["finish_reason"]


def test_streamed_tool_calls_arrive_name_first_then_argument_fragments():
    req = request(tools=[WEATHER, TIME], stream=True)
    text = (
        "Let me look. <tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Nice", "unit": "C"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]  # cuts the tags too
    job = finished_job(req, text)
    frames = stream_frames(req, job, pieces)
    content, calls, reason = assembled(frames)
    whole = chat_body(req, job)["choices"][0]
    assert reason == whole["finish_reason"] == "tool_calls"
    assert content == whole["message"]["content"] == "Let me look."
    assert calls == whole["message"]["tool_calls"]
    entries = [e for f in frames for e in f["choices"][0]["delta"].get("tool_calls", [])]
    first = entries[0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"] == calls[0]["id"]
    assert first["function"]["name"] == "get_weather"
    fragments = [e["function"]["arguments"] for e in entries if e["index"] == 0]
    assert len(fragments) > 3  # the arguments stream, they do not come at the end in one piece
    assert "".join(fragments) == whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert [e["index"] for e in entries if "id" in e] == [0, 1]
    assert "tool_call" not in content and "{" not in content


def test_a_streamed_forced_call_streams_its_arguments_and_matches_the_whole_response():
    req = request(tools=[WEATHER], tool_choice="required", stream=True)
    text = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
    job = finished_job(req, text)
    frames = stream_frames(req, job, [text[i : i + 3] for i in range(0, len(text), 3)])
    content, calls, reason = assembled(frames)
    whole = chat_body(req, job)["choices"][0]
    assert (content, calls, reason) == ("", whole["message"]["tool_calls"], "tool_calls")
    argument_frames = [
        f
        for f in frames
        if any(e["function"]["arguments"] for e in f["choices"][0]["delta"].get("tool_calls", []))
    ]
    assert len(argument_frames) > 5


def test_streamed_plain_content_with_tools_is_not_held_to_the_end():
    req = request(tools=[WEATHER], stream=True)
    job = finished_job(req, "It is sunny today.")
    frames = stream_frames(req, job, ["It", " is", " sunny", " today."])
    assert [f["choices"][0]["delta"].get("content") for f in frames] == [
        "It",
        " is",
        " sunny",
        " today.",
    ]
    assert frames[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_openai_client_gets_the_same_calls_streamed_and_whole(stack):
    """Over HTTP with the official client, against the echo worker (which says the input back
    word by word, so the call in the user's message comes back as the model's, in pieces)."""
    import openai

    api = stack.api()
    stack.worker()
    call = '<tool_call> {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}} </tool_call>'
    fields: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": f"Weather? {call}"}],
        tools=[WEATHER],
        max_tokens=500,
    )
    with openai.OpenAI(base_url=api.url + "/v1", api_key=ALICE_KEY, max_retries=0) as sdk:
        whole = sdk.chat.completions.create(**fields).choices[0]
        chunks = [c for c in sdk.chat.completions.create(**fields, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    entries = [e for d in deltas for e in d.tool_calls or []]
    (started,) = [e for e in entries if e.id is not None]
    assert started.index == 0 and started.type == "function"
    assert started.function.name == "get_weather"
    fragments = [e.function.arguments for e in entries if e.function and e.function.arguments]
    assert len(fragments) > 1
    assert whole.finish_reason == chunks[-1].choices[0].finish_reason == "tool_calls"
    (whole_call,) = whole.message.tool_calls
    assert whole_call.function.name == "get_weather"
    assert "".join(fragments) == whole_call.function.arguments
    assert json.loads(whole_call.function.arguments) == {"city": "Oslo", "unit": "C"}
    streamed_content = "".join(d.content or "" for d in deltas)
    assert streamed_content == whole.message.content
    assert "Oslo" not in streamed_content  # the call's markup never shows as content
