"""Pooling parameters: how one embedding request turns a model's hidden states into a vector.
Shared by the wire contract (an embedding job) and the engine, as SamplingParams is."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field


class PoolingType(enum.StrEnum):
    """Which token states make the vector."""

    LAST = "last"  # the last token's state (decoder embedding models, e.g. Qwen3-Embedding)
    MEAN = "mean"  # the mean over every token (most sentence-transformers encoders)
    CLS = "cls"  # the first token's state (BERT's [CLS])


class PoolingParams(BaseModel):
    """Per-request overrides of the model's own pooling; None keeps what the model says."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dimensions: int | None = Field(
        None,
        ge=1,
        description="keep the first this many dimensions (Matryoshka), normalized after "
        "truncation where the model normalizes",
    )
    normalize: bool | None = Field(None, description="L2-normalize the vector")
    pooling_type: PoolingType | None = Field(None, description="override the model's pooling")
