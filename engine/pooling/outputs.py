"""What the pooling engine takes and gives: a request in; per request one pooled vector out,
in the shapes vLLM's offline API returns (`outputs[i].outputs.embedding`, `.outputs.data`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from schemas.pooling import PoolingParams


@dataclass(frozen=True)
class PoolingRequest:
    request_id: str
    prompt: str | list[int]  # text, or token ids
    params: PoolingParams = field(default_factory=PoolingParams)
    arrival_time: float | None = None  # time.monotonic(); None: now
    token_type_ids: list[int] | None = None  # an encoder's segments (a text pair's second: 1)


@dataclass(frozen=True)
class PooledResult:
    """One finished request of a pooling step."""

    request_id: str
    prompt_token_ids: list[int]
    data: torch.Tensor  # float32 [dimensions], on the CPU


@dataclass
class PoolingOutput:
    data: torch.Tensor

    @property
    def embedding(self) -> list[float]:
        """The vector as a list, as vLLM's EmbeddingOutput holds it."""
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
