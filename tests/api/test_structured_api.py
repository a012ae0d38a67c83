"""Structured-output constraints at the API: every way of asking (OpenAI's response_format,
vLLM's structured_outputs and guided_* extras, the jobs API) reaches the job as one constraint,
and a malformed one is a 400 (422 on the jobs API) naming it, with nothing queued."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from redis import Redis

from producer_api.openai_jobs import chat_job, completion_job
from producer_api.openai_models import ChatCompletionRequest, CompletionRequest
from schemas import RedisKeys
from schemas.structured import StructuredOutput
from tests.api.conftest import MODEL, auth

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


def chat_constraint(**fields: Any) -> StructuredOutput | None:
    request = ChatCompletionRequest(model=MODEL, messages=MESSAGES, **fields)
    return chat_job(request, 16, 30.0).sampling.structured_output


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
            StructuredOutput(json_schema=SCHEMA),
        ),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json_schema=SCHEMA)),
        ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutput(choice=["x", "y"])),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutput(regex="[0-9]+")),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput(grammar='root ::= "a"')),
        ({"guided_json": SCHEMA}, StructuredOutput(json_schema=SCHEMA)),
        ({"guided_json": '{"type": "object"}'}, StructuredOutput(json_schema={"type": "object"})),
        ({"guided_regex": "a+"}, StructuredOutput(regex="a+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput(choice=["yes", "no"])),
        ({"guided_grammar": 'root ::= "b"'}, StructuredOutput(grammar='root ::= "b"')),
    ],
)  # fmt: skip
def test_each_way_of_asking_gives_the_job_its_constraint(fields, want):
    assert chat_constraint(**fields) == want


def test_completions_take_the_vllm_extras():
    request = CompletionRequest(model=MODEL, prompt="x", guided_choice=["a", "b"])
    job = completion_job(request, "x", 8, 30.0)
    assert job.sampling.structured_output == StructuredOutput(choice=["a", "b"])


@pytest.fixture
def queued(stack):
    """An API with a worker, and a function telling how many jobs were ever queued."""
    api = stack.api()
    stack.worker()
    redis = Redis.from_url(stack.redis_url)

    def count() -> int:
        try:
            return redis.xinfo_stream(RedisKeys().jobs_stream(MODEL))["entries-added"]
        except Exception:
            return 0

    yield api, count
    redis.close()


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "invalid JSON schema"),
        ({"guided_regex": "a("}, "guided_regex", "invalid regex"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", ""),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"whatever": 1}}, "structured_outputs", ""),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one structured-output"),
        ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "invalid EBNF grammar at line 1, column 15: expected an element"),
        ({"structured_outputs": {"grammar": 'root ::= "a"\nitem ::= [z-a]'}}, "structured_outputs", "line 2, column 11: character range z-a runs backwards"),
        ({"structured_outputs": {"grammar": "start ::= word\nword ::= [a-z]+"}}, "structured_outputs", "no root rule"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "no tool named"),
    ],
)  # fmt: skip
def test_a_malformed_constraint_is_400_naming_it_and_nothing_is_queued(
    queued, fields, param, words
):
    api, count = queued
    before = count()
    body = {"model": MODEL, "messages": MESSAGES, **fields}
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param)
    assert words in error["message"]
    assert count() == before


def test_the_jobs_api_takes_the_constraint_and_refuses_a_bad_one(queued):
    api, count = queued
    body = {"model": MODEL, "prompt": "hi", "sampling": {"max_tokens": 4}}
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        good = {**body, "sampling": {"max_tokens": 4, "structured_output": {"regex": "[ab]+"}}}
        created = http.post("/v1/jobs", json=good)
        assert created.status_code in (200, 201, 202), created.text
        before = count()
        refusals = []
        for constraint in ({"regex": "(("}, {"grammar": 'root ::= "a" undefined'}):
            bad = {**body, "sampling": {"max_tokens": 4, "structured_output": constraint}}
            refusals.append(http.post("/v1/jobs", json=bad))
    assert [r.status_code for r in refusals] == [422, 422]
    (regex, grammar) = (r.json()["error"] for r in refusals)
    assert regex["param"] == "sampling.structured_output.regex"
    assert "invalid regex" in regex["message"]
    assert grammar["param"] == "sampling.structured_output.grammar"
    assert "line 1, column 14: rule 'undefined' is not defined" in grammar["message"]
    assert count() == before


def test_grpc_requests_carry_the_same_constraint():
    from producer_api.errors import ApiError
    from producer_api.grpc.requests import job_request, message_field
    from producer_api.grpc.stubs import inference_pb2 as pb

    def built(**constraint: Any):
        request = pb.ChatCompletionsRequest(
            model_id=MODEL,
            messages=[pb.ChatMessage(role="user", content="hi")],
            structured_output=pb.StructuredOutput(**constraint),
        )
        return job_request(request, 8, stream=False, timeout_s=5).sampling.structured_output

    assert built(json_schema='{"type": "object"}') == StructuredOutput(
        json_schema={"type": "object"}
    )
    assert built(choice=pb.Choices(choices=["a", "b"])) == StructuredOutput(choice=["a", "b"])
    assert built(regex="[0-9]+") == StructuredOutput(regex="[0-9]+")
    assert built(json_object=True) == StructuredOutput(json_object=True)
    for bad in ({"regex": "(("}, {"json_schema": "{nope"}, {"grammar": 'root ::= "a" |'}):
        with pytest.raises(ApiError) as caught:
            built(**bad)
        param = caught.value.error.param or ""
        assert message_field(param) == f"structured_output.{next(iter(bad))}"


def test_a_batch_line_with_a_bad_grammar_is_an_invalid_line_naming_it():
    from producer_api.batches.lines import parse_line

    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "structured_outputs": {"grammar": 'root ::= "a" | "b'},
    }
    raw = json.dumps(
        {"custom_id": "g", "method": "POST", "url": "/v1/chat/completions", "body": body}
    )
    line = parse_line(7, raw, None, 16)
    assert not line.ok and line.request is None
    assert line.error is not None and line.error.param == "body.structured_outputs"
    assert "line 1, column 18: unterminated string literal" in line.error.message
