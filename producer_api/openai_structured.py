"""The structured-output constraint of an OpenAI-style request, from whichever way it was asked:
OpenAI's `response_format`, vLLM's `structured_outputs` object, or vLLM's older `guided_*`
fields. At most one way per request; a malformed constraint is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from producer_api.errors import ApiError
from schemas import ErrorCode
from schemas.structured import StructuredOutput


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`. Every schema is enforced by the grammar, so `strict`
    is accepted either way."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, JsonValue] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` request object (the names its current docs use)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, JsonValue] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class GuidedFields(BaseModel):
    """vLLM's pre-0.12 extra fields, still sent by many clients."""

    guided_json: dict[str, JsonValue] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None


def _json_object(value: dict[str, JsonValue] | str, param: str) -> dict[str, JsonValue]:
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise _invalid(param, f"not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise _invalid(param, "a JSON schema must be an object")
    return parsed


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(ErrorCode.INVALID_REQUEST, f"{param}: {message}", param)


def _constraint(fields: dict[str, Any], param: str) -> StructuredOutput:
    try:
        return StructuredOutput.model_validate(fields)
    except ValidationError as exc:
        message = str(exc.errors(include_url=False)[0]["msg"]).removeprefix("Value error, ")
        raise _invalid(param, message) from exc


def structured_output(
    guided: GuidedFields, response_format: ResponseFormat | None
) -> StructuredOutput | None:
    """The one constraint the request asks for, or None."""
    asked: list[tuple[str, dict[str, Any]]] = []
    if response_format is not None and response_format.type != "text":
        asked.append(("response_format", _from_response_format(response_format)))
    if guided.guided_json is not None:
        schema = _json_object(guided.guided_json, "guided_json")
        asked.append(("guided_json", {"json_schema": schema}))
    if guided.guided_regex is not None:
        asked.append(("guided_regex", {"regex": guided.guided_regex}))
    if guided.guided_choice is not None:
        asked.append(("guided_choice", {"choice": guided.guided_choice}))
    if guided.guided_grammar is not None:
        asked.append(("guided_grammar", {"grammar": guided.guided_grammar}))
    if guided.structured_outputs is not None:
        asked.append(("structured_outputs", _from_vllm(guided.structured_outputs)))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise _invalid(asked[1][0], f"give one structured-output constraint (got {names})")
    param, fields = asked[0]
    return _constraint(fields, param)


def _from_response_format(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type != "json_schema":
        raise _invalid("response_format.type", "must be one of text, json_object, json_schema")
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise _invalid("response_format.json_schema", "json_schema.schema is required")
    return {"json_schema": response_format.json_schema.schema_}


def _from_vllm(params: StructuredOutputsParams) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if params.json_ is not None:
        fields["json_schema"] = _json_object(params.json_, "structured_outputs.json")
    if params.regex is not None:
        fields["regex"] = params.regex
    if params.choice is not None:
        fields["choice"] = params.choice
    if params.grammar is not None:
        fields["grammar"] = params.grammar
    if params.json_object:
        fields["json_object"] = True
    return fields
