"""The small OpenAI/vLLM gaps: /tokenize, /detokenize, /version, `echo` on completions, and
`logit_bias` reaching the job."""

from __future__ import annotations

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from engine.model_files import resolve_model_path
from producer_api.openai_jobs import completion_job
from producer_api.openai_models import CompletionRequest
from tests.api.conftest import ALICE_KEY, MODEL, auth
from tests.api.echo_worker import echo_output


@pytest.fixture(scope="module")
def tokenizer_file():
    path = resolve_model_path("SmolLM2-135M-Instruct") / "tokenizer.json"
    if not path.exists():
        pytest.skip("the default model is not prepared")
    return path


@pytest.mark.model
def test_tokenize_and_detokenize_round_trip(stack, tokenizer_file):
    api = stack.api()
    stack.worker(max_model_len=512, tokenizer_file=tokenizer_file)
    want = Tokenizer.from_file(str(tokenizer_file)).encode("Hello structured world")
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        body = {"model": MODEL, "prompt": "Hello structured world", "return_token_strs": True}
        tokens = http.post("/tokenize", json=body).json()
        assert tokens["tokens"] == want.ids
        assert tokens["count"] == len(want.ids) and tokens["max_model_len"] == 512
        assert tokens["token_strs"] == want.tokens
        back = http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
        assert back.json()["prompt"] == "Hello structured world"
        unknown = http.post("/tokenize", json={**body, "model": "nope"})
        assert unknown.status_code == 404
        assert http.get("/version").json()["version"]


def test_tokenize_without_a_readable_tokenizer_is_404_naming_the_model(stack):
    api = stack.api()
    stack.worker()
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        response = http.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"
    assert "tokenizer" in response.json()["error"]["message"]


def test_echo_puts_the_prompt_before_the_completion(stack):
    api = stack.api()
    stack.worker(max_model_len=64)
    prompt = "one two three"
    with openai.OpenAI(base_url=api.url + "/v1", api_key=ALICE_KEY, max_retries=0) as sdk:
        response = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True)
        plain = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
        streamed = sdk.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, echo=True, stream=True
        )
        text = "".join(c.choices[0].text for c in streamed if c.choices)
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3, echo=True)
    assert response.choices[0].text == prompt + plain.choices[0].text
    assert plain.choices[0].text == echo_output_text(prompt)
    assert text == response.choices[0].text
    assert caught.value.param == "echo"


def echo_output_text(prompt: str) -> str:
    from schemas import JobRequest

    return echo_output(JobRequest(model=MODEL, prompt=prompt, sampling={"max_tokens": 3})).text


def test_logit_bias_reaches_the_job_by_token_id():
    request = CompletionRequest(model=MODEL, prompt="x", logit_bias={"42": 100, "7": -100})
    job = completion_job(request, "x", 4, 30.0)
    assert job.sampling.logit_bias == {42: 100.0, 7: -100.0}
    with pytest.raises(Exception, match="logit_bias"):
        completion_job(
            CompletionRequest(model=MODEL, prompt="x", logit_bias={"42": 101}), "x", 4, 30.0
        )
