"""Sampling parameters: the one definition shared by the wire contract and the engine, and how
an interface declares its sampling fields from it (`sampling_field`, `sampling_values`)."""

from __future__ import annotations

from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from schemas.errors import field_error
from schemas.structured import StructuredOutput

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_BAD_WORDS = 64
MAX_ALLOWED_TOKEN_IDS = 100_000


class SamplingParams(BaseModel):
    """How to pick tokens. Defaults give greedy-free sampling at temperature 1, like OpenAI."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(1, ge=1, le=MAX_N, description="number of choices to generate")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    max_tokens: int = Field(16, ge=1, le=1_000_000)
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    skip_special_tokens: bool = True
    # Beam search (vLLM's extras): n is the beam width, and the n best beams are returned.
    use_beam_search: bool = False
    length_penalty: float = Field(
        1.0, ge=-10.0, le=10.0, description="beam score = cumulative logprob / length**this"
    )
    structured_output: StructuredOutput | None = Field(
        None, description="constrain the output to a JSON schema, regex, choice or grammar"
    )
    logit_bias: dict[int, float] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id -> bias added to its logit"
    )
    # vLLM's extras.
    best_of: int | None = Field(
        None,
        ge=1,
        le=MAX_N,
        description="generate this many choices and return the n of highest cumulative logprob",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="each prompt token's logprob, and this many alternatives at each position",
    )
    allowed_token_ids: list[int] | None = Field(
        None,
        min_length=1,
        max_length=MAX_ALLOWED_TOKEN_IDS,
        description="only these token ids may be generated",
    )
    bad_words: list[str] = Field(
        default_factory=list,
        max_length=MAX_BAD_WORDS,
        description="words never generated (their last token is banned after the rest)",
    )
    include_stop_str_in_output: bool = Field(
        False, description="keep the stop string (or stop token's text) in the output"
    )
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, description="keep only the prompt's last this many tokens"
    )

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (disabled) or at least 1")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        if isinstance(value, str):
            return [value]
        return [] if value is None else value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_ids_non_negative(cls, value: list[int] | None, info: ValidationInfo) -> object:
        if value is not None and any(t < 0 for t in value):
            raise ValueError(f"{info.field_name} must be non-negative token ids")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words_not_blank(cls, value: list[str]) -> list[str]:
        if any(not word.strip() for word in value):
            raise ValueError("bad_words must not be blank")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value is not None:
            if any(token_id < 0 for token_id in value):
                raise ValueError("logit_bias keys must be non-negative token ids")
            if any(not -100.0 <= bias <= 100.0 for bias in value.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise field_error("min_tokens", "min_tokens must not exceed max_tokens")
        if self.top_logprobs and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs requires logprobs=true")
        if self.use_beam_search and self.logprobs:
            raise field_error("logprobs", "logprobs are not available with use_beam_search")
        if self.use_beam_search and self.structured_output is not None:
            raise field_error(
                "structured_output", "structured output is not available with use_beam_search"
            )
        if self.best_of is not None:
            if self.best_of < self.n:
                raise field_error("best_of", "best_of must be at least n")
            if self.use_beam_search and self.best_of != self.n:
                raise field_error("best_of", "with use_beam_search, n is the beam width")
        if self.use_beam_search and self.allowed_token_ids is not None:
            raise field_error(
                "allowed_token_ids", "allowed_token_ids are not available with use_beam_search"
            )
        if self.use_beam_search and self.bad_words:
            raise field_error("bad_words", "bad_words are not available with use_beam_search")
        if self.use_beam_search and self.prompt_logprobs is not None:
            raise field_error(
                "prompt_logprobs", "prompt_logprobs are not available with use_beam_search"
            )
        return self

    def token_outside_vocabulary(self, vocab_size: int) -> tuple[str, int] | None:
        """The first (field, token id) of logit_bias and allowed_token_ids that a model of
        `vocab_size` tokens does not have, or None: what the API and the engine refuse."""
        for field, ids in (
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            for token in ids:
                if token >= vocab_size:
                    return field, token
        return None

    @property
    def num_candidates(self) -> int:
        """Choices generated: best_of where it asks for more than the n returned."""
        return max(self.n, self.best_of or 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# What an interface publishes of a field's bounds: all of them, the lower only (where something
# else bounds it from above there, as the model's context bounds max_tokens), or none.
PublishedBounds = Literal["all", "lower", "none"]
_UPPER_BOUNDS = (Le, Lt, MaxLen)
_BOUNDS = (Ge, Gt, MinLen, *_UPPER_BOUNDS)
_CONTRACT_DEFAULT = object()


def sampling_field(
    name: str,
    default: object = _CONTRACT_DEFAULT,
    *,
    bounds: PublishedBounds = "all",
    description: str | None = None,
) -> Any:
    """SamplingParams field `name` as an interface declares it in its own type: the field's
    bounds and description, with `default` (left out: SamplingParams' own; an interface whose
    unset fields are None gives None, and SamplingParams' default applies once the job is
    built). Typed Any, as `Field()` is."""
    declared = SamplingParams.model_fields[name]
    overrides: dict[str, Any] = {}
    if default is not _CONTRACT_DEFAULT:
        overrides.update(default=default, default_factory=None)
    if description is not None:
        overrides["description"] = description
    field = FieldInfo.merge_field_infos(declared, **overrides)
    if bounds != "all":
        dropped = _BOUNDS if bounds == "none" else _UPPER_BOUNDS
        field.metadata = [m for m in declared.metadata if not isinstance(m, dropped)]
    return field


def sampling_values(request: BaseModel, **computed: object) -> dict[str, object]:
    """The SamplingParams values `request` gives: its fields named as SamplingParams' are, except
    those in `computed` (which the interface names or shapes otherwise), and `computed` adds
    them. A None value is left out, so SamplingParams' default applies."""
    shared = SamplingParams.model_fields.keys() & type(request).model_fields.keys()
    given: dict[str, object] = request.model_dump(
        include=shared - computed.keys(), exclude_none=True
    )
    given.update((name, value) for name, value in computed.items() if value is not None)
    return given
