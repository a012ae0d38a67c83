"""An interface declares SamplingParams' fields in its own types (`sampling_field`) and reads
them back by name (`sampling_values`): the bounds and defaults stay SamplingParams'."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from schemas import SamplingParams
from schemas.sampling import sampling_field, sampling_values


class WireRequest(BaseModel):
    """An interface's body: optional fields left None, the contract's default otherwise."""

    n: int = sampling_field("n")
    temperature: float | None = sampling_field("temperature", None)
    max_tokens: int | None = sampling_field("max_tokens", bounds="lower")
    length_penalty: float | None = sampling_field("length_penalty", None, bounds="none")
    stop_token_ids: list[int] = sampling_field("stop_token_ids")
    best_of: int | None = sampling_field("n", None, description="the same bounds as n")
    user: str | None = None  # not a sampling field


def _messages(model: type[BaseModel], fields: dict[str, object]) -> list[str]:
    with pytest.raises(ValidationError) as refused:
        model.model_validate(fields)
    return [error["msg"] for error in refused.value.errors()]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("n", 0),
        ("n", 17),
        ("stop_token_ids", [0] * 65),
    ],
)
def test_a_declared_field_refuses_what_sampling_params_refuses_with_its_message(name, value):
    assert _messages(WireRequest, {name: value}) == _messages(SamplingParams, {name: value})


def test_defaults_are_sampling_params_unless_the_interface_gives_its_own():
    request = WireRequest()
    assert (request.n, request.max_tokens, request.stop_token_ids) == (1, 16, [])
    assert request.temperature is None and request.best_of is None


def test_published_bounds_can_be_the_lower_ones_or_none():
    assert WireRequest(max_tokens=2_000_000).max_tokens == 2_000_000  # no upper bound here
    assert _messages(WireRequest, {"max_tokens": 0}) == _messages(SamplingParams, {"max_tokens": 0})
    assert WireRequest(length_penalty=50.0).length_penalty == 50.0
    # the field of another name keeps the bounds and takes its own description
    assert _messages(WireRequest, {"best_of": 17}) == _messages(SamplingParams, {"n": 17})
    assert WireRequest.model_fields["best_of"].description == "the same bounds as n"
    assert WireRequest.model_fields["n"].description == SamplingParams.model_fields["n"].description


def test_sampling_values_reads_the_shared_fields_by_name_and_leaves_none_unset():
    request = WireRequest(n=2, temperature=None, length_penalty=0.5, user="u")
    values = sampling_values(request, max_tokens=9, seed=None, logprobs=True)
    assert values == {
        "n": 2,
        "length_penalty": 0.5,
        "stop_token_ids": [],
        "max_tokens": 9,
        "logprobs": True,
    }
    sampling = SamplingParams.model_validate(values)
    assert sampling.temperature == SamplingParams().temperature  # unset: the contract's default
