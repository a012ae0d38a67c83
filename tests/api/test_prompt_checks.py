"""A client's mistakes the API can see (a token id outside the vocabulary, a prompt too long for
the context) are refused before anything is queued, on every route that enqueues; the bounds
come from the workers' heartbeats, and text is counted with the tokenizer a worker advertises."""

from __future__ import annotations

import httpx
import openai
import pytest
from redis import Redis

from producer_api.errors import ApiError
from producer_api.prompt_check import PromptLimits, check_prompt
from producer_api.prompt_tokens import TokenizerCache
from schemas import ErrorCode, JobRequest
from tests.api.conftest import ALICE_KEY, KEYS, MODEL, auth
from tests.api.echo_worker import ECHO_VOCAB, write_echo_tokenizer

CONTEXT = 64
LONG = " ".join(["w"] * 70)  # 70 echo tokens: past the context on its own


def _never_queued(stack, worker) -> None:
    """Nothing reached the model's stream, no job record was written, the worker ran nothing."""
    with Redis.from_url(stack.redis_url, decode_responses=True) as redis:
        assert redis.xinfo_stream(KEYS.jobs_stream(MODEL))["entries-added"] == 0
        assert list(redis.scan_iter(KEYS.job("*"))) == []
    assert worker.served == []


@pytest.fixture
def served(stack, tmp_path):
    api = stack.api()
    worker = stack.worker(max_model_len=CONTEXT, tokenizer_file=write_echo_tokenizer(tmp_path))
    return api, worker


def test_out_of_vocabulary_ids_never_reach_the_stream(stack, served):
    api, worker = served
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        jobs = http.post("/v1/jobs", json={"model": MODEL, "prompt_token_ids": [5, ECHO_VOCAB, 7]})
        negative = http.post("/v1/jobs", json={"model": MODEL, "prompt_token_ids": [-1]})
        nested = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": [[1, 2], [3, ECHO_VOCAB + 9]]}
        )
    assert jobs.status_code == 422
    assert jobs.json()["error"]["code"] == "invalid_token_id"
    assert jobs.json()["error"]["param"] == "prompt_token_ids.1"
    assert str(ECHO_VOCAB) in jobs.json()["error"]["message"]
    assert (negative.status_code, negative.json()["error"]["param"]) == (422, "prompt_token_ids.0")
    assert nested.status_code == 400
    assert nested.json()["error"] == {
        "message": nested.json()["error"]["message"],
        "type": "invalid_request_error",
        "param": "prompt.1.1",
        "code": "invalid_token_id",
    }
    _never_queued(stack, worker)


def test_context_too_long_never_reaches_the_stream(stack, served):
    api, worker = served
    with openai.OpenAI(base_url=api.url + "/v1", api_key=ALICE_KEY, max_retries=0) as sdk:
        with pytest.raises(openai.BadRequestError) as completion:
            sdk.completions.create(model=MODEL, prompt=LONG, max_tokens=4)
        with pytest.raises(openai.BadRequestError) as chat:
            sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": LONG}], stream=True
            )
        with pytest.raises(openai.BadRequestError) as ids:
            sdk.completions.create(model=MODEL, prompt=[1] * 60, max_tokens=8)
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        job = http.post("/v1/jobs", json={"model": MODEL, "prompt": LONG})
    assert (completion.value.code, completion.value.param) == ("context_length_exceeded", "prompt")
    assert (chat.value.code, chat.value.param) == ("context_length_exceeded", "messages")
    assert (ids.value.code, ids.value.param) == ("context_length_exceeded", "prompt")
    assert job.status_code == 422
    assert (job.json()["error"]["code"], job.json()["error"]["param"]) == (
        "context_length_exceeded",
        "prompt",
    )
    _never_queued(stack, worker)


def test_prompts_that_fit_still_run(served):
    api, worker = served
    with openai.OpenAI(base_url=api.url + "/v1", api_key=ALICE_KEY, max_retries=0) as sdk:
        fits = " ".join(["w"] * 50)
        response = sdk.completions.create(model=MODEL, prompt=fits, max_tokens=4)
        assert response.usage.prompt_tokens == 50
        chat = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=2
        )
        assert chat.choices[0].message.content == "hello there"
    assert len(worker.served) == 2


def test_without_a_heartbeat_the_worker_decides(stack):
    """Before any worker beats, the API knows no vocabulary: the job is queued (the worker will
    fail it with invalid_token_id, a failed job and no dead letter)."""
    api = stack.api()
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        queued = http.post("/v1/jobs", json={"model": MODEL, "prompt_token_ids": [ECHO_VOCAB]})
        assert queued.status_code == 202
        stack.worker()
        done = http.get(f"/v1/jobs/{queued.json()['id']}/wait", params={"timeout": 10}).json()
    assert done["status"] == "failed" and done["error"]["code"] == "invalid_token_id"


@pytest.mark.anyio
async def test_a_chat_is_refused_only_for_what_every_template_keeps(tmp_path):
    """A template may rewrite earlier assistant turns (drop their reasoning): only system, user
    and tool contents count, so the API never refuses a chat a worker would run."""
    tokenizers = TokenizerCache()
    tokenizer = await tokenizers.get(str(write_echo_tokenizer(tmp_path)))
    limits = PromptLimits(context=CONTEXT, vocab_size=ECHO_VOCAB, tokenizer=tokenizer)

    def chat(*turns: tuple[str, str]) -> JobRequest:
        messages = [{"role": role, "content": content} for role, content in turns]
        return JobRequest(model=MODEL, messages=messages, sampling={"max_tokens": 4})

    await check_prompt(chat(("user", "hi"), ("assistant", LONG), ("user", "go on")), limits, "m")
    with pytest.raises(ApiError) as caught:
        await check_prompt(chat(("system", LONG), ("user", "go on")), limits, "messages")
    assert (caught.value.error.code, caught.value.error.param) == (
        ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        "messages",
    )
    assert await tokenizers.get(str(tmp_path / "elsewhere" / "tokenizer.json")) is None
