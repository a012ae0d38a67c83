"""What the engine hands back: per-step deltas for streaming, whole outputs for offline use."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestDelta:
    """New output of one choice of one request in one engine step."""

    request_id: str
    choice_index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" once the choice is done
    stop_reason: str | int | None = None
    request_finished: bool = False  # every choice of the request is done

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = False


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

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_blocks_free / self.num_blocks_total if self.num_blocks_total else 0.0
