"""Structured output: the constraint a job's tokens must satisfy (a JSON schema, any JSON object,
a regex, a choice among strings, or an EBNF grammar).

What can be checked without the grammar library is checked here, so a malformed constraint is
refused at the door: a JSON schema against its metaschema, a regex by Python's `re`, an EBNF
grammar by a syntax check of the library's dialect (line and column of the problem). What only
the library can tell (a grammar it cannot compile) fails the job with the library's message.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from schemas.ebnf import GrammarSyntaxError, check_ebnf
from schemas.errors import field_error

MAX_CONSTRAINT_CHARS = 100_000
MAX_CHOICES = 256

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class StructuredOutput(BaseModel):
    """Exactly one constraint. Generation ends (finish_reason "stop") once the output is complete
    under it; an output the constraint cannot complete within max_tokens ends with "length"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: dict[str, JsonValue] | None = Field(
        None, description="a JSON schema the output must validate against"
    )
    json_object: bool = Field(False, description="any JSON object")
    regex: str | None = Field(None, min_length=1, max_length=MAX_CONSTRAINT_CHARS)
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(
        None, min_length=1, max_length=MAX_CONSTRAINT_CHARS, description="EBNF, root rule `root`"
    )

    @field_validator("json_schema")
    @classmethod
    def _schema_valid(cls, value: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        if value is None:
            return None
        if len(json.dumps(value)) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"the JSON schema is longer than {MAX_CONSTRAINT_CHARS} characters")
        try:
            Draft202012Validator.check_schema(value)
        except SchemaError as exc:
            where = "/".join(str(part) for part in exc.absolute_path) or "(root)"
            raise ValueError(f"invalid JSON schema at {where}: {exc.message}") from None
        return value

    @field_validator("regex")
    @classmethod
    def _regex_valid(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"invalid regex: {exc}") from None
        return value

    @field_validator("grammar")
    @classmethod
    def _grammar_valid(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                check_ebnf(value)
            except GrammarSyntaxError as exc:
                raise ValueError(f"invalid EBNF grammar at {exc}") from None
        return value

    @field_validator("choice")
    @classmethod
    def _choices_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not choice for choice in value):
            raise ValueError("choices must be non-empty strings")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutput:
        given = self.kinds_given()
        if len(given) != 1:
            got = ", ".join(given) or "none"
            raise field_error(
                given[1] if len(given) > 1 else "json_schema",
                f"give exactly one of json_schema, json_object, regex, choice, grammar (got {got})",
            )
        return self

    def kinds_given(self) -> list[ConstraintKind]:
        given: list[ConstraintKind] = []
        if self.json_schema is not None:
            given.append("json_schema")
        if self.json_object:
            given.append("json_object")
        if self.regex is not None:
            given.append("regex")
        if self.choice is not None:
            given.append("choice")
        if self.grammar is not None:
            given.append("grammar")
        return given

    @property
    def kind(self) -> ConstraintKind:
        return self.kinds_given()[0]

    def cache_key(self) -> str:
        """Equal for equal constraints: what compiled grammars are cached by."""
        return self.model_dump_json(exclude_defaults=True)
