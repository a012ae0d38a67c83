"""The `speculative_config` engine argument, named as vLLM names it.

`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}`
proposes the tokens that followed the latest earlier occurrence of the sequence's last n tokens
(prompt lookup); `{"method": "draft_model", "model": PATH_OR_NAME, "num_speculative_tokens": k}`
runs a small model of the same vocabulary with its own KV cache. Either turns itself off for
the whole step when more than `disable_by_batch_size` sequences decode, and for one sequence a
while when its running acceptance rate falls below `min_acceptance_rate`.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        json_schema_extra={"examples": [{"method": "ngram", "num_speculative_tokens": 4}]},
    )

    method: Literal["ngram", "draft_model"] = Field(
        description="ngram: prompt lookup; draft_model: a small model of the same vocabulary"
    )
    num_speculative_tokens: int = Field(ge=1, le=16, description="tokens proposed per step")
    prompt_lookup_min: int = Field(2, ge=1, description="ngram: shortest suffix to look up")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: longest suffix to look up")
    model: str | None = Field(None, description="draft_model: registry name, HF folder or hub id")
    # On a 2-core CPU with the default model a 5-token step measured 1.2x a decode step at
    # batch 1 but 2.4x at batch 4 and 3.5x at batch 8; a GPU stays memory-bound far longer.
    disable_by_batch_size: int | None = Field(
        2,
        ge=1,
        description="no speculation in a step where more sequences than this decode (the step "
        "is compute-bound there, so verifying rejected tokens costs about what it saves; "
        "raise it on a GPU); None: never by batch size",
    )
    min_acceptance_rate: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="a sequence whose running acceptance rate falls below this stops "
        "speculating for a while (it costs a wider step and rarely pays)",
    )

    @model_validator(mode="after")
    def _check_method_fields(self) -> Self:
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config: method "draft_model" needs "model"')
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config: "model" belongs to method "draft_model" only')
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                "speculative_config: prompt_lookup_min must not exceed prompt_lookup_max"
            )
        return self


def parse_speculative_config(
    value: SpeculativeConfig | dict | str | None,
) -> SpeculativeConfig | None:
    """The config from a model, a dict or its JSON text (flags, environment, `LLM(...)`)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        return SpeculativeConfig.model_validate_json(value)
    return SpeculativeConfig.model_validate(value)
