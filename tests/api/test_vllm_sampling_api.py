"""vLLM's sampling fields over every route: a bad value (a logit_bias id past the vocabulary or
a bias past 100, allowed_token_ids outside it, best_of below n, ...) is refused naming the field
before anything is queued, on /v1/completions, /v1/chat/completions, /v1/jobs, /generate and
gRPC; good values reach the job; echo with logprobs answers the prompt's logprobs first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from redis import Redis

from producer_api.grpc.stubs import inference_pb2 as pb
from schemas import Job
from tests.api.conftest import KEYS, MODEL, Stack, auth
from tests.api.echo_worker import ECHO_VOCAB, write_echo_tokenizer
from tests.api.grpc_stack import GrpcClient, grpc_server, metadata, trailing

CONTEXT = 64
JOB_KEYS = KEYS.job("x")[:-1] + "*"  # every job's hash (KEYS.job escapes a literal "*")

# (the sampling fields as a vLLM user sends them, the field a refusal names)
BAD_INPUT = [
    ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
    ({"logit_bias": {ECHO_VOCAB: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {5: -100.5}}, "logit_bias"),
    ({"allowed_token_ids": [3, ECHO_VOCAB]}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 9}, "best_of"),  # past the server's max_n (8)
    ({"bad_words": ["  "]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
]


@pytest.fixture
def served(stack: Stack, tmp_path: Path):
    api = stack.api()
    worker = stack.worker(max_model_len=CONTEXT, tokenizer_file=write_echo_tokenizer(tmp_path))
    return api, worker


def _never_queued(stack: Stack, worker) -> None:
    with Redis.from_url(stack.redis_url, decode_responses=True) as redis:
        assert redis.xinfo_stream(KEYS.jobs_stream(MODEL))["entries-added"] == 0
        assert list(redis.scan_iter(JOB_KEYS)) == []
    assert worker.served == []


def _openai(fields: dict) -> dict:
    """The fields as JSON has them (logit_bias keys are strings)."""
    if "logit_bias" in fields:
        return {**fields, "logit_bias": {str(k): v for k, v in fields["logit_bias"].items()}}
    return fields


@pytest.mark.parametrize(("fields", "param"), BAD_INPUT)
def test_bad_sampling_input_is_refused_on_every_http_route_naming_the_field(
    stack, served, fields, param
):
    api, worker = served
    body = _openai(fields)
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        answers = {
            "completions": http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "hello there", **body}
            ),
            "generate": http.post("/generate", json={"prompt": "hello there", **body}),
            "jobs": http.post(
                "/v1/jobs", json={"model": MODEL, "prompt": "hello there", "sampling": body}
            ),
        }
        if param != "best_of":  # chat completions have no best_of (as OpenAI's)
            answers["chat"] = http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body},
            )
    for route, answer in answers.items():
        jobs_route = route == "jobs"
        assert answer.status_code == (422 if jobs_route else 400), (route, answer.text)
        error = answer.json()["error"]
        assert error["param"] == (f"sampling.{param}" if jobs_route else param), (route, error)
        assert param in error["message"]
    _never_queued(stack, worker)


@pytest.fixture
def grpc_client(served, stack: Stack) -> Iterator[GrpcClient]:
    with grpc_server(stack) as client:
        yield client


@pytest.mark.parametrize(("fields", "param"), BAD_INPUT)
def test_bad_sampling_input_is_invalid_argument_over_grpc(
    grpc_client, stack, served, fields, param
):
    if fields == {"allowed_token_ids": []}:
        pytest.skip("an empty repeated field is an unset one in proto3")
    request = pb.CompletionsRequest(model_id=MODEL, prompt="hello there", **fields)
    with pytest.raises(grpc.RpcError) as failed:
        grpc_client.stub.CreateCompletion(request, metadata=metadata(), timeout=30)
    assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT, failed.value.details()
    assert trailing(failed.value)["error-param"] == param
    _never_queued(stack, served[1])


def _job(stack: Stack) -> Job:
    with Redis.from_url(stack.redis_url, decode_responses=True) as redis:
        (key,) = list(redis.scan_iter(JOB_KEYS))
        return Job.from_redis_hash(redis.hgetall(key))


GOOD = {
    "best_of": 3,
    "n": 2,
    "allowed_token_ids": [1, 2, 3],
    "bad_words": ["hello"],
    "include_stop_str_in_output": True,
    "truncate_prompt_tokens": 5,
    "logit_bias": {7: -100.0, ECHO_VOCAB - 1: 100.0},
}


def test_vllm_fields_reach_the_job_over_openai_completions(stack, served):
    api, _ = served
    with httpx.Client(base_url=api.url, headers=auth(), timeout=30) as http:
        answer = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hello there", "prompt_logprobs": 2, **_openai(GOOD)},
        )
    assert answer.status_code == 200, answer.text
    sampling = _job(stack).request.sampling
    assert (sampling.best_of, sampling.n, sampling.prompt_logprobs) == (3, 2, 2)
    assert sampling.allowed_token_ids == [1, 2, 3] and sampling.bad_words == ["hello"]
    assert sampling.include_stop_str_in_output and sampling.truncate_prompt_tokens == 5
    assert sampling.logit_bias == GOOD["logit_bias"]


def test_generate_takes_every_sampling_field_of_the_old_vllm_server(stack, served):
    api, _ = served
    body = {
        "prompt": "hello there",
        "n": 1,
        "best_of": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "seed": 42,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "max_tokens": 8,
        "min_tokens": 1,
        "stop": ["zzz"],
        "stop_token_ids": [9],
        "include_stop_str_in_output": True,
        "ignore_eos": True,
        "logprobs": 2,
        "prompt_logprobs": 1,
        "skip_special_tokens": False,
        "truncate_prompt_tokens": 4,
        "bad_words": ["nope"],
        "allowed_token_ids": [1, 2],
        "use_beam_search": False,
        "length_penalty": 1.0,
    }
    with httpx.Client(base_url=api.url, headers=auth(), timeout=30) as http:
        answer = http.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    sampling = _job(stack).request.sampling
    assert sampling.logprobs and sampling.top_logprobs == 2
    for name, value in body.items():
        if name not in ("prompt", "logprobs", "stop"):
            assert getattr(sampling, name) == value, name
    assert sampling.stop == ["zzz"]


def test_echo_with_logprobs_answers_the_prompts_logprobs_first(stack, served):
    api, _ = served
    with httpx.Client(base_url=api.url, headers=auth(), timeout=30) as http:
        answer = http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "one two three",
                "echo": True,
                "logprobs": 1,
                "max_tokens": 2,
            },
        )
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == "one two three" + "one two"
    # three prompt tokens (the first unscored), then the two generated
    assert logprobs["tokens"] == ["one", " two", " three", "one", " two"]
    assert logprobs["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"]) == 5
    assert logprobs["text_offset"] == [0, 3, 7, 13, 16]
    assert _job(stack).request.sampling.prompt_logprobs == 1


def test_prompt_logprobs_come_back_as_vllm_answers_them(stack, served):
    api, _ = served
    with httpx.Client(base_url=api.url, headers=auth(), timeout=30) as http:
        completion = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "one two three", "prompt_logprobs": 1},
        )
        chat = http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "four five"}],
                "prompt_logprobs": 0,
                "max_tokens": 4,
            },
        )
    assert completion.status_code == 200 and chat.status_code == 200, (completion.text, chat.text)
    scored = completion.json()["choices"][0]["prompt_logprobs"]
    assert len(scored) == 3 and scored[0] is None
    assert [entry["decoded_token"] for item in scored[1:] for entry in item.values()] == [
        " two",
        " three",
    ]
    chat_scored = chat.json()["prompt_logprobs"]
    assert len(chat_scored) == 2 and chat_scored[0] is None


def test_prompt_logprobs_over_grpc_equal_the_http_api(stack, served, grpc_client):
    api, _ = served
    request = pb.CompletionsRequest(
        model_id=MODEL, prompt="one two three", prompt_logprobs=1, num_tokens=2
    )
    reply = grpc_client.stub.CreateCompletion(request, metadata=metadata(), timeout=30)
    with httpx.Client(base_url=api.url, headers=auth(), timeout=30) as http:
        body = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "one two three", "prompt_logprobs": 1, "max_tokens": 2},
        ).json()
    http_scored = body["choices"][0]["prompt_logprobs"]
    assert len(reply.prompt_logprobs) == len(http_scored) == 3
    assert not reply.prompt_logprobs[0].HasField("logprob") and http_scored[0] is None
    for ours, theirs in zip(reply.prompt_logprobs[1:], http_scored[1:], strict=True):
        scored = theirs[str(ours.logprob.token_id)]
        assert ours.logprob.token == scored["decoded_token"]
        assert ours.logprob.logprob == pytest.approx(scored["logprob"])
        assert len(ours.logprob.top_logprobs) == 1
    job = grpc_client.stub.GetJob(pb.GetJobRequest(job_id=reply.job_id), metadata=metadata())
    assert list(job.prompt_logprobs) == list(reply.prompt_logprobs)
    unasked = grpc_client.stub.CreateCompletion(
        pb.CompletionsRequest(model_id=MODEL, prompt="one two", num_tokens=1),
        metadata=metadata(),
        timeout=30,
    )
    assert len(unasked.prompt_logprobs) == 0
