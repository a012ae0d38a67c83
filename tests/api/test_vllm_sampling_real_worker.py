"""vLLM's sampling fields over the queue against a real worker on the default model: echo with
logprobs answers the prompt's logprobs as the offline engine scores them, best_of the same
choice as the offline engine, allowed_token_ids only allowed tokens, and a logit_bias id past
the real vocabulary is refused before queueing."""

from __future__ import annotations

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.api.conftest import auth
from tests.api.test_grpc_real_worker import MAX_MODEL_LEN, MODEL, real_system

pytestmark = [pytest.mark.slow, pytest.mark.model]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with real_system(tmp_path_factory, "--dtype", "float32") as running:
        yield running


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, dtype="float32", max_model_len=MAX_MODEL_LEN)


def test_echo_with_logprobs_scores_the_prompt_as_the_offline_engine(system, offline):
    stack, _ = system
    with httpx.Client(base_url=stack.servers[0].url, headers=auth(), timeout=120) as http:
        answer = http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": PROMPT,
                "echo": True,
                "logprobs": 1,
                "max_tokens": 3,
                "temperature": 0,
            },
        )
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    expected = offline.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1), use_tqdm=False
    )[0]
    scored = expected.prompt_logprobs
    assert scored is not None
    logprobs = choice["logprobs"]
    num_prompt = len(expected.prompt_token_ids)
    assert len(logprobs["tokens"]) == num_prompt + 3
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:num_prompt] == pytest.approx(
        [item.logprob for item in scored[1:] if item is not None], abs=1e-4
    )
    assert "".join(logprobs["tokens"][:num_prompt]) == PROMPT
    assert choice["text"] == PROMPT + expected.outputs[0].text


def test_best_of_and_allowed_token_ids_over_the_queue(system, offline):
    stack, _ = system
    allowed = offline.tokenizer.encode(" Paris London Rome", add_special_tokens=False)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    with httpx.Client(base_url=stack.servers[0].url, headers=auth(), timeout=120) as http:
        best = http.post("/generate", json={**body, "n": 1, "best_of": 3})
        only = http.post(
            "/v1/completions",
            json={"model": MODEL, **body, "allowed_token_ids": allowed, "logprobs": 0},
        )
        too_big = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "logit_bias": {str(10**6): 5}},
        )
    assert best.status_code == 200, best.text
    params = SamplingParams(n=1, best_of=3, seed=3, temperature=1.0, max_tokens=6, ignore_eos=True)
    expected = offline.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    assert best.json()["text"] == [PROMPT + expected]
    assert only.status_code == 200, only.text
    tokens = only.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6
    assert all(token in {offline.tokenizer.decode([t]) for t in allowed} for token in tokens)
    assert too_big.status_code == 400
    assert too_big.json()["error"]["param"] == "logit_bias"
