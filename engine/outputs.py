"""What crosses the engine's boundary: the request that goes in; per-step deltas (for
streaming), whole outputs and stats that come back. Plain dataclasses, no torch: the worker
and its test fakes type against them cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.lora.request import LoRARequest
from schemas.chunks import FinishReason
from schemas.pooling import PoolingParams
from schemas.sampling import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """One request for the engine.

    `prior_output_token_ids` resumes choices that already produced tokens elsewhere (a worker
    taking over a job), one list per choice: they are re-prefilled, not re-generated."""

    request_id: str
    prompt: str | list[int]  # text, or token ids
    params: SamplingParams
    priority: int = 0  # lower runs first
    arrival_time: float | None = None  # time.monotonic(); None: now
    prior_output_token_ids: list[list[int]] | None = None
    pooling: PoolingParams | None = None  # an embedding request (a pooling engine's only kind)
    token_type_ids: list[int] | None = None  # a cross-encoder's text pair: the second is 1
    # a pooling request of several inputs (token ids each), each pooled into its own vector;
    # `prompt` is then unused. A pooling engine that takes them finishes the request once every
    # input is pooled, with `RequestOutput.embeddings`
    inputs: list[list[int]] | None = None
    lora_request: LoRARequest | None = None  # run with this LoRA adapter (engine.lora)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    # The text of the token and of each alternative, by id; empty when the model has no
    # tokenizer.
    token_texts: dict[int, str] = field(default_factory=dict)


@dataclass
class RequestMetrics:
    """Monotonic-clock timestamps (seconds) of one request's life in the engine."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # a beam search output's score before length penalty


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = False
    # With params.prompt_logprobs: one entry per prompt token, None for the first (as vLLM).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # a pooling engine's output
    # a request of several inputs: one vector per input, and each input's token count
    embeddings: list[list[float]] | None = None
    input_token_counts: list[int] | None = None


@dataclass
class RequestDelta:
    """New output of one choice of one request in one engine step.

    The delta that finishes the request (every choice done) carries its whole output: the one
    way a finished request's output leaves the engine."""

    request_id: str
    choice_index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None  # "stop", "length", "abort" once it is done
    stop_reason: str | int | None = None
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def request_finished(self) -> bool:
        return self.output is not None


@dataclass
class EngineStats:
    num_blocks_total: int
    num_blocks_free: int
    num_blocks_cached: int
    num_running: int
    num_waiting: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_prompt_tokens_computed: int
    num_generation_tokens: int
    num_preemptions: int
    num_steps: int
    # Speculative decoding: verification steps of a sequence with draft tokens, the draft
    # tokens proposed in them and how many the model accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # LoRA adapter ids in the engine's slots (usable this step) and those in host memory only
    # (max_cpu_loras), least recently used first.
    lora_resident: tuple[int, ...] = ()
    lora_cached: tuple[int, ...] = ()

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed draft token."""
        if not self.spec_num_draft_tokens:
            return 0.0
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    @property
    def spec_mean_accepted_length(self) -> float:
        """Draft tokens accepted per verification step (each step also yields one more)."""
        return self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_blocks_free / self.num_blocks_total if self.num_blocks_total else 0.0
