"""`POST /generate`, vLLM's simple endpoint: the issue's seed request answers prompt plus
completion, streaming gives newline-delimited JSON ending in the same texts, bad input is a 4xx
naming the field, and nothing reaches the queue then."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from redis import Redis

from schemas import JobRequest, RedisKeys
from tests.api.conftest import MODEL, Stack, auth
from tests.api.echo_worker import echo_output

SEED_REQUEST = {
    "prompt": "The capital of France is",
    "n": 1,
    "use_beam_search": False,
    "temperature": 0.7,
    "max_tokens": 10,
}


def echoed(body: dict) -> str:
    request = JobRequest.model_validate(
        {"model": MODEL, "prompt": body["prompt"], "sampling": {"max_tokens": body["max_tokens"]}}
    )
    return body["prompt"] + "".join(echo_output(request).pieces)


@pytest.fixture
def http(stack: Stack):
    api = stack.api()
    stack.worker()
    with httpx.Client(base_url=api.url, headers=auth(), timeout=30) as client:
        yield client


def test_the_seed_request_answers_prompt_plus_completion(http):
    response = http.post("/generate", json=SEED_REQUEST)
    assert response.status_code == 200, response.text
    assert response.json() == {"text": [echoed(SEED_REQUEST)]}


def test_n_choices_come_back_as_n_texts(http):
    body = {**SEED_REQUEST, "n": 3, "model": MODEL}
    texts = http.post("/generate", json=body).json()["text"]
    assert texts == [echoed(body)] * 3


def test_streaming_sends_ndjson_of_the_texts_so_far(http):
    body = {**SEED_REQUEST, "stream": True}
    with http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    texts = [line["text"][0] for line in lines]
    assert len(lines) > 1
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert texts[-1] == echoed(body)


def test_the_same_keys_guard_it(stack: Stack):
    api = stack.api()
    response = httpx.post(f"{api.url}/generate", json=SEED_REQUEST)
    assert response.status_code == 401


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"best_of_everything": True}, "best_of_everything"),
        ({"model": "no-such-model"}, "model"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(stack: Stack, http, change: dict, field: str):
    response = http.post("/generate", json={**SEED_REQUEST, **change})
    assert 400 <= response.status_code < 500, response.text
    assert field in response.text
    keys = RedisKeys()
    redis = Redis.from_url(stack.redis_url)
    try:
        assert redis.xlen(keys.queue_stream(MODEL, 0)) == 0
    finally:
        redis.close()
