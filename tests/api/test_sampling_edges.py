"""The sampling fields of every interface are SamplingParams': the OpenAI and /generate bodies
publish its bounds (or, where noted, fewer of them), and each sampling field of a gRPC message
reaches the job."""

from __future__ import annotations

import pytest

from producer_api.app import create_app
from producer_api.grpc.requests import job_request
from producer_api.grpc.stubs import inference_pb2 as pb
from producer_api.settings import ApiSettings
from schemas import SamplingParams

BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "maxItems", "minItems")
BODIES = ("CompletionRequest", "ChatCompletionRequest", "GenerateRequest")
# OpenAI names the number of alternatives of a completion `logprobs` (vLLM's /generate too).
SAME_BOUNDS_AS = {
    ("CompletionRequest", "logprobs"): "top_logprobs",
    ("GenerateRequest", "logprobs"): "top_logprobs",
}
# Published with fewer bounds than SamplingParams checks once the job is built: max_tokens is
# bounded by the model's context, the others take their OpenAI form, or a looser one on /generate.
FEWER_BOUNDS = {"max_tokens", "max_completion_tokens", "stop", "logit_bias", "length_penalty"}
GENERATE_FEWER = {"n", "best_of", "temperature"}


def _bounds(schema: dict) -> dict[str, float]:
    """The bounds of a property, whether it may be null or not (as floats: the published
    document writes 2**63 - 1 as one)."""
    found = {key: float(schema[key]) for key in BOUNDS if key in schema}
    for option in schema.get("anyOf", []):
        found.update(_bounds(option))
    return found


@pytest.fixture(scope="module")
def schemas() -> dict[str, dict]:
    return create_app(ApiSettings(auth_disabled=True)).openapi()["components"]["schemas"]


@pytest.mark.parametrize("body", BODIES)
def test_published_sampling_bounds_are_sampling_params_bounds(schemas, body):
    contract = SamplingParams.model_json_schema()["properties"]
    checked = 0
    for name, schema in schemas[body]["properties"].items():
        source = SAME_BOUNDS_AS.get((body, name)) or SAME_BOUNDS_AS.get(("*", name), name)
        if source not in contract:
            continue
        published, declared = _bounds(schema), _bounds(contract[source])
        fewer = name in FEWER_BOUNDS or (body == "GenerateRequest" and name in GENERATE_FEWER)
        if fewer:
            assert published.items() <= declared.items(), (body, name)
        else:
            assert published == declared, (body, name)
        checked += 1
    assert checked >= (8 if body == "GenerateRequest" else 18)


# A value other than the default for every sampling field of the gRPC messages, valid together.
GRPC_VALUES = {
    "temperature": 0.5,
    "top_p": 0.75,
    "top_k": 5,
    "min_p": 0.25,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.25,
    "seed": 7,
    "n": 2,
    "stop_sequences": ["."],
    "stop_token_ids": [3],
    "min_tokens": 1,
    "ignore_eos": True,
    "logprobs": True,
    "top_logprobs": 2,
    "skip_special_tokens": False,
}
BEAM_VALUES = {"use_beam_search": True, "length_penalty": 0.5}
VLLM_VALUES = {
    "logit_bias": {5: 1.5, 9: -100.0},
    "allowed_token_ids": [1, 2, 5],
    "bad_words": ["no"],
    "include_stop_str_in_output": True,
    "truncate_prompt_tokens": 4,
    "best_of": 3,
    "prompt_logprobs": 2,
}
RENAMED = {"stop_sequences": "stop", "num_tokens": "max_tokens"}


@pytest.mark.parametrize("message", [pb.CompletionsRequest, pb.ChatCompletionsRequest])
def test_every_sampling_field_of_a_grpc_message_reaches_the_job(message):
    names = {field.name for field in message.DESCRIPTOR.fields}
    sampled = {name for name in names if RENAMED.get(name, name) in SamplingParams.model_fields}
    assert sampled == {
        *GRPC_VALUES,
        *BEAM_VALUES,
        *VLLM_VALUES,
        "num_tokens",
        "structured_output",
    }
    prompt = {"messages": [pb.ChatMessage(role="user", content="hi")]}
    if message is pb.CompletionsRequest:
        prompt = {"prompt": "hi"}
    for values in (GRPC_VALUES, BEAM_VALUES, VLLM_VALUES):
        request = message(model_id="m", **prompt, **values)
        if values is GRPC_VALUES:  # beam search takes no constraint
            request.structured_output.regex = "a+"
        sampling = job_request(request, 9, stream=False, timeout_s=30).sampling
        for name, value in values.items():
            assert getattr(sampling, RENAMED.get(name, name)) == value, name
        assert sampling.max_tokens == 9
        assert (sampling.structured_output is not None) == (values is GRPC_VALUES)
