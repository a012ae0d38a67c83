"""Acceptance against the real system: uvicorn on a free port, a real Redis, and a real worker
process (`inferq worker`) on the default model, driven by the official `openai` package.
Greedy outputs must equal the offline `engine.LLM`'s, and usage must count the same tokens."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from schemas import RedisKeys
from tests.api.conftest import ALICE_KEY, Stack, auth
from tests.api.real_worker import real_worker_stack
from tests.api.test_jobs_api import sse_events

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512  # the worker's context, small so "too long" prompts stay cheap
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]
MAX_TOKENS = 12
READY_TIMEOUT_S = 300

pytestmark = [pytest.mark.slow, pytest.mark.model]


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of the offline engine, the ground truth."""
    from engine import LLM, SamplingParams

    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    completions = llm.generate(PROMPTS, greedy, use_tqdm=False)
    chat = llm.chat(CHAT, greedy, use_tqdm=False)[0]
    yield {"completions": completions, "chat": chat}
    del llm


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> Iterator[Stack]:
    with real_worker_stack(
        tmp_path_factory, MODEL, "--max-model-len", str(MAX_MODEL_LEN), max_n=4
    ) as stack:
        yield stack


@pytest.fixture
def sdk(system) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=system.servers[0].url + "/v1", api_key=ALICE_KEY, max_retries=0, timeout=120
    ) as client:
        yield client


def test_completions_match_the_offline_engine(sdk, reference):
    for prompt, want in zip(PROMPTS, reference["completions"], strict=True):
        out = want.outputs[0]
        response = sdk.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert response.choices[0].text == out.text
        assert response.usage.prompt_tokens == len(want.prompt_token_ids)
        assert response.usage.completion_tokens == len(out.token_ids)
        assert response.usage.total_tokens == len(want.prompt_token_ids) + len(out.token_ids)
        stream = sdk.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == out.text
        assert chunks[-1].usage.completion_tokens == len(out.token_ids)


def test_chat_matches_the_offline_engine(sdk, reference):
    want = reference["chat"]
    out = want.outputs[0]
    response = sdk.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.choices[0].message.content == out.text
    assert response.usage.prompt_tokens == len(want.prompt_token_ids)
    assert response.usage.completion_tokens == len(out.token_ids)
    stream = sdk.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == out.text


def test_n_with_a_seed_gives_n_choices(sdk):
    response = sdk.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, n=2, seed=1234, temperature=0.9
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.message.content for c in response.choices)
    assert response.usage.completion_tokens >= 2


def test_too_long_prompt_is_400_context_length_exceeded(sdk, system):
    """The API counts the prompt with the tokenizer the worker advertises: refused at the door,
    nothing queued."""
    long_prompt = "hello " * (MAX_MODEL_LEN + 50)
    stream = RedisKeys().jobs_stream(MODEL)
    with Redis.from_url(system.redis_url) as redis:
        queued_before = redis.xinfo_stream(stream)["entries-added"]
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4)
        assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "prompt")
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": long_prompt}], stream=True
            )
        assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "messages")
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.completions.create(model=MODEL, prompt=[1, 49152], max_tokens=4)
        assert (caught.value.code, caught.value.param) == ("invalid_token_id", "prompt.1")
        assert redis.xinfo_stream(stream)["entries-added"] == queued_before


@pytest.fixture(scope="module")
def token_text():
    """What a logprob names a token: its id decoded on its own (as vLLM does)."""
    from engine.model_files import resolve_model_path
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(MODEL))
    special = set(tokenizer.all_special_tokens)
    return lambda token_id: tokenizer.decode([token_id]), special


def _completion_logprobs(sdk: openai.OpenAI, stream: bool) -> tuple[str, dict[str, list]]:
    response = sdk.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
        stream=stream,
    )  # fmt: skip
    parts = list(response) if stream else [response]
    text = "".join(p.choices[0].text for p in parts if p.choices)
    merged: dict[str, list] = {"tokens": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        logprobs = part.choices[0].logprobs if part.choices else None
        for name, values in merged.items():
            values += getattr(logprobs, name, None) or []
    return text, merged


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_name_real_tokens(sdk, reference, token_text, stream):
    decode, special = token_text
    want = reference["completions"][0].outputs[0]
    text, logprobs = _completion_logprobs(sdk, stream)
    tokens = logprobs["tokens"]
    assert text == want.text
    assert tokens == [decode(t) for t in want.token_ids]
    assert "".join(t for t in tokens if t not in special) == text
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    for token, top in zip(tokens, logprobs["top_logprobs"], strict=True):
        assert len(top) == 2 and token in top  # greedy: the chosen token is the likeliest
        assert not any(key.startswith("token_id:") for key in top)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_name_real_tokens_and_their_bytes(sdk, reference, token_text, stream):
    decode, special = token_text
    want = reference["chat"].outputs[0]
    response = sdk.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        top_logprobs=2, stream=stream,
    )  # fmt: skip
    if stream:
        parts = [c.choices[0] for c in response if c.choices]
        text = "".join(p.delta.content or "" for p in parts)
        content = [t for p in parts if p.logprobs for t in p.logprobs.content or []]
    else:
        text = response.choices[0].message.content
        content = response.choices[0].logprobs.content
    assert text == want.text
    assert [t.token for t in content] == [decode(t) for t in want.token_ids]
    assert "".join(t.token for t in content if t.token not in special) == text
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        for top in entry.top_logprobs:
            assert not top.token.startswith("token_id:")
            assert top.bytes == list(top.token.encode())


def test_jobs_stream_resumes_with_last_event_id(system, reference):
    want = reference["completions"][0].outputs[0]
    body = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "stream": True,
        "sampling": {"temperature": 0, "max_tokens": MAX_TOKENS},
    }
    with httpx.Client(base_url=system.servers[0].url, headers=auth(), timeout=120) as http:
        job = http.post("/v1/jobs", json=body).json()
        with http.stream("GET", job["links"]["stream"]) as response:
            first = sse_events(response, limit=3)
        with http.stream(
            "GET", job["links"]["stream"], headers={"Last-Event-ID": first[-1].id}
        ) as response:
            rest = sse_events(response)
    chunks = [json.loads(e.data) for e in first + rest if e.event == "chunk"]
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert "".join(c.get("text", "") for c in chunks) == want.text
    assert json.loads(rest[-1].data)["result"]["choices"][0]["text"] == want.text


def test_a_prometheus_scrape_has_the_vllm_series(system, sdk):
    """After a few requests, the vLLM-named series a vLLM Grafana board reads, with sane values
    (counters and histogram counts may include the other tests' requests)."""
    model = {"model_name": MODEL}
    interactive = {**model, "priority": "interactive"}
    ttft_count = "vllm:time_to_first_token_seconds_count"
    with httpx.Client(base_url=system.servers[0].url, timeout=10) as http:
        before = _value(_scrape(http), ttft_count, **interactive)
        usage = [
            sdk.completions.create(
                model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0
            ).usage
            for p in PROMPTS
        ]
        give_up = time.monotonic() + 30  # the samples come with the worker's next heartbeats
        while True:
            scraped = _scrape(http)
            counted = _value(scraped, ttft_count, **interactive) >= before + len(PROMPTS)
            if counted and _value(scraped, "vllm:num_requests_running", **model) == 0:
                break
            assert time.monotonic() < give_up, "the requests did not reach /metrics"
            time.sleep(0.5)
    assert _value(scraped, "vllm:generation_tokens_total", **model) >= sum(
        u.completion_tokens for u in usage
    )
    assert _value(scraped, "vllm:prompt_tokens_total", **model) >= sum(
        u.prompt_tokens for u in usage
    )
    assert 0.0 <= _value(scraped, "vllm:kv_cache_usage_perc", **model) <= 1.0
    assert _value(scraped, "vllm:num_requests_waiting", **model) == 0
    ttft_sum = _value(scraped, "vllm:time_to_first_token_seconds_sum", **interactive)
    e2e_sum = _value(scraped, "vllm:e2e_request_latency_seconds_sum", **interactive)
    assert 0.0 < ttft_sum < e2e_sum
    gaps = _value(scraped, "vllm:inter_token_latency_seconds_count", **interactive)
    assert gaps >= sum(u.completion_tokens - 1 for u in usage)
    assert (
        0.0 < _value(scraped, "vllm:inter_token_latency_seconds_sum", **interactive) / gaps < 10.0
    )


def _value(
    scraped: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return scraped.get((name, tuple(sorted(labels.items()))), 0.0)


def _scrape(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for s in family.samples
    }
