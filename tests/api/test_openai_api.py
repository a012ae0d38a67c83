"""The OpenAI-compatible endpoints, driven by the official `openai` package, against the echo
worker (the real-worker parity tests are in test_real_worker.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from schemas import JobRequest
from tests.api.conftest import ALICE_KEY, MODEL, auth
from tests.api.echo_worker import echo_output, logprob_of

PROMPT = "alpha beta gamma delta epsilon"
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there friend"},
]


def expected(max_tokens: int, *, prompt: str | None = None, messages=None):
    if messages is not None:
        request = JobRequest(
            model=MODEL,
            messages=[{"role": m["role"], "content": m["content"]} for m in messages],
            sampling={"max_tokens": max_tokens},
        )
    else:
        request = JobRequest(model=MODEL, prompt=prompt, sampling={"max_tokens": max_tokens})
    return echo_output(request)


@pytest.fixture
def client(stack):
    api = stack.api(max_n=4)
    stack.worker(max_model_len=64)
    with openai.OpenAI(base_url=api.url + "/v1", api_key=ALICE_KEY, max_retries=0) as sdk:
        yield sdk


def test_completion_non_stream_and_stream_agree(client):
    want = expected(3, prompt=PROMPT)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    assert response.choices[0].text == want.text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == want.prompt_tokens
    assert response.usage.completion_tokens == len(want.pieces)
    assert response.usage.total_tokens == want.prompt_tokens + len(want.pieces)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == response.usage


def test_a_bulk_priority_stream_reaches_its_end(client):
    """A request of bulk priority (vLLM's `priority` field) is queued on the bulk stream and
    still streams to its end, as any worker of the model reads that stream too."""
    want = expected(3, prompt=PROMPT)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, stream=True, extra_body={"priority": 6}
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.text


def test_continuous_usage_stats_report_usage_so_far_on_every_chunk(client):
    want = expected(4, prompt=PROMPT)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = list(stream)
    texts = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) == len(want.pieces)
    for seen, chunk in enumerate(texts, start=1):
        assert chunk.usage.prompt_tokens == want.prompt_tokens
        assert chunk.usage.completion_tokens == seen
        assert chunk.usage.total_tokens == want.prompt_tokens + seen
    final = chunks[-1].usage
    assert (final.prompt_tokens, final.completion_tokens) == (want.prompt_tokens, 4)


def test_chat_non_stream_and_stream_agree(client):
    want = expected(50, messages=MESSAGES)
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    message = response.choices[0].message
    assert (message.role, message.content) == ("assistant", want.text)
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == len(want.pieces)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, max_completion_tokens=50
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert {c.id for c in chunks} == {chunks[0].id}


def test_n_choices_and_several_prompts(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=7)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == 2 * len(expected(50, messages=MESSAGES).pieces)
    prompts = ["a b c", "d e f g"]
    completion = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8)
    by_index = {c.index: c.text for c in completion.choices}
    assert by_index == {
        i * 2 + k: expected(8, prompt=p).text for i, p in enumerate(prompts) for k in range(2)
    }
    assert completion.usage.prompt_tokens == sum(
        expected(8, prompt=p).prompt_tokens for p in prompts
    )
    streamed = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=8, stream=True
    )
    texts: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == by_index


def test_logprobs_in_both_apis(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, max_tokens=2
    )
    pieces = expected(2, messages=MESSAGES).pieces
    content = chat.choices[0].logprobs.content
    assert [t.token for t in content] == pieces
    assert [t.logprob for t in content] == [logprob_of(p) for p in pieces]
    assert all(len(t.top_logprobs) == 2 for t in content)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=1, max_tokens=2)
    lp = completion.choices[0].logprobs
    assert lp.tokens == expected(2, prompt=PROMPT).pieces
    assert lp.text_offset == [0, len(lp.tokens[0])]


def test_streamed_logprobs_name_tokens_with_offsets_and_bytes(client):
    pieces = expected(4, prompt=PROMPT).pieces
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, logprobs=2, max_tokens=4, stream=True
    )
    tokens, offsets, tops = [], [], []
    for chunk in stream:
        logprobs = chunk.choices[0].logprobs if chunk.choices else None
        if logprobs is not None:
            tokens += logprobs.tokens
            offsets += logprobs.text_offset
            tops += logprobs.top_logprobs
    assert tokens == pieces
    assert offsets == [len("".join(pieces[:i])) for i in range(len(pieces))]
    assert [next(iter(top)) for top in tops] == pieces
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, max_tokens=3, stream=True
    )
    content = [
        token for c in chat if c.choices and c.choices[0].logprobs
        for token in c.choices[0].logprobs.content
    ]  # fmt: skip
    assert [t.token for t in content] == expected(3, messages=MESSAGES).pieces
    assert all(t.bytes == list(t.token.encode()) for t in content)
    assert all(top.bytes == list(top.token.encode()) for t in content for top in t.top_logprobs)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="hi")
    assert caught.value.code == "model_not_found"


def test_context_too_long_is_400_with_openai_code(client):
    long_prompt = " ".join(["w"] * 70)  # the echo worker's context is 64 "tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4)
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_prompt}], stream=True
        )
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:  # known without asking the worker
        client.completions.create(model=MODEL, prompt="short", max_tokens=64)
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "max_tokens")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 5}, "n"),
        ({"temperature": 3}, "temperature"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_invalid_chat_requests_are_400_naming_the_field(client, fields, param):
    body = {"model": MODEL, "messages": MESSAGES, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)
    assert caught.value.status_code == 400
    assert caught.value.param is not None and caught.value.param.startswith(param)


def test_models_lists_only_models_with_live_workers(stack):
    api = stack.api(models=["configured-only"])
    stack.worker("model-a")
    stack.worker("model-a", name="echo-a2", max_model_len=128)
    stack.worker("model-b")
    with openai.OpenAI(base_url=api.url + "/v1", api_key=ALICE_KEY) as sdk:
        models = sdk.models.list()
        assert [m.id for m in models.data] == ["model-a", "model-b"]
        assert sdk.models.retrieve("model-a").id == "model-a"
        with pytest.raises(openai.NotFoundError):
            sdk.models.retrieve("configured-only")
    stack.stop_workers()  # their heartbeats go
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        assert http.get("/v1/models").json()["data"] == []


def test_models_name_the_quantization_their_workers_run(stack):
    """One method when a model's workers agree (None: full precision), "mixed" when not, and
    every method in `quantizations` either way."""
    api = stack.api(models=[])
    stack.worker("gguf-model", name="q1", quantization="gguf")
    stack.worker("gguf-model", name="q2", quantization="gguf")
    stack.worker("mixed-model", name="m1", quantization="int4")
    stack.worker("mixed-model", name="m2")
    stack.worker("mixed-model", name="m3", quantization="gguf")
    stack.worker("full-model", name="f1")
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
        one = http.get("/v1/models/mixed-model").json()
    assert (cards["gguf-model"]["quantization"], cards["gguf-model"]["quantizations"]) == (
        "gguf",
        ["gguf"],
    )
    assert cards["gguf-model"]["workers"] == 2
    assert cards["mixed-model"]["quantization"] == "mixed"
    assert cards["mixed-model"]["quantizations"] == [None, "gguf", "int4"]
    assert one == cards["mixed-model"]
    assert (cards["full-model"]["quantization"], cards["full-model"]["quantizations"]) == (
        None,
        [None],
    )


def test_models_name_the_architectures_their_workers_serve(stack):
    api = stack.api(models=[])
    stack.worker("moe-model", name="a1", architecture="GptOssForCausalLM")
    stack.worker("moe-model", name="a2", architecture="GptOssForCausalLM")
    stack.worker("mixed-model", name="b1", architecture="Qwen3ForCausalLM")
    stack.worker("mixed-model", name="b2", architecture="LlamaForCausalLM")
    stack.worker("mixed-model", name="b3")  # a worker too old to say
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
        one = http.get("/v1/models/moe-model").json()
    assert cards["moe-model"]["architectures"] == ["GptOssForCausalLM"]
    assert one == cards["moe-model"]
    assert cards["mixed-model"]["architectures"] == ["LlamaForCausalLM", "Qwen3ForCausalLM"]


def test_missing_key_is_401_for_openai_routes(stack):
    api = stack.api()
    sdk = openai.OpenAI(base_url=api.url + "/v1", api_key="sk-nope", max_retries=0)
    with sdk, pytest.raises(openai.AuthenticationError):
        sdk.models.list()


def test_auth_disabled_accepts_any_key(stack):
    api = stack.api(api_keys={}, auth_disabled=True)
    stack.worker()
    with openai.OpenAI(base_url=api.url + "/v1", api_key="anything", max_retries=0) as sdk:
        response = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert response.choices[0].text == expected(2, prompt=PROMPT).text


def test_queue_full_is_429_with_retry_after(stack):
    api = stack.api(queue_limits={MODEL: 1}, retry_after_s=3)
    stack.heartbeat(MODEL)  # a live worker that takes nothing: the queue stays full
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        assert http.post("/v1/jobs", json={"model": MODEL, "prompt": "x"}).status_code == 202
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "3"
    assert refused.json()["error"]["code"] == "queue_full"
