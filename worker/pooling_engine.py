"""A pooling engine (embeddings) behind the slice of the engine a worker drives (EngineLike):
an embedding job goes in as an EngineRequest with pooling params, and comes out in the step
that runs it as one finishing delta whose output carries the vector. No KV cache is held
between steps, so the heartbeat reports no blocks and admission counts waiting requests."""

from __future__ import annotations

import time
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import RequestRejectedError
from engine.outputs import (
    CompletionOutput,
    EngineRequest,
    EngineStats,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
)
from engine.pooling.engine import PoolingEngine
from engine.pooling.outputs import PoolingRequest
from engine.quantization.methods import weight_bytes
from schemas.jobs import JobKind


class PoolingWorkerEngine:
    quantization: str | None = None
    block_size = 1

    def __init__(self, config: EngineConfig) -> None:
        self.pooling = PoolingEngine(config)
        # A cross-encoder takes score jobs (text pairs); its outputs are label scores.
        self.task = JobKind.EMBEDDING if self.pooling.num_labels is None else JobKind.SCORE
        self.max_model_len = self.pooling.max_model_len
        # as the folder's config names it (encoders are not in the generating families' registry)
        self.architecture: str | None = next(iter(self.pooling.hf_config.architectures or []), None)
        self.vocab_size = self.pooling.vocab_size
        self.embedding_size: int | None = (
            self.pooling.hidden_size if self.task is JobKind.EMBEDDING else None
        )
        runner = self.pooling.runner
        model = runner.encoder if runner.encoder is not None else runner.decoder
        assert model is not None
        self.weight_bytes = weight_bytes(model)
        tokenizer_json = self.pooling.model_path / "tokenizer.json"
        self.tokenizer_file: Path | None = (
            tokenizer_json.resolve() if tokenizer_json.exists() else None
        )
        self._arrivals: dict[str, float] = {}
        self._max_num_seqs = config.max_num_seqs

    def tokenize(self, text: str) -> list[int]:
        return self.pooling.tokenize(text)

    def tokenize_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        if self.task is not JobKind.SCORE:
            raise RequestRejectedError(
                "this model embeds single texts; text pairs need a cross-encoder"
            )
        return self.pooling.tokenize_pair(first, second)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        raise RequestRejectedError("an embedding model takes prompt or prompt_token_ids")

    def add_request(self, new: EngineRequest) -> None:
        if new.pooling is None:
            raise RequestRejectedError(
                f"this model serves {self.task.value} jobs; generation needs a generating model"
            )
        if (new.token_type_ids is None) == (self.task is JobKind.SCORE):
            raise RequestRejectedError(
                f"this model serves {self.task.value} jobs: "
                + ("a text pair (prompt_pair)" if self.task is JobKind.SCORE else "one text")
            )
        arrival = new.arrival_time or time.monotonic()
        request = PoolingRequest(
            new.request_id, new.prompt, new.pooling, arrival, token_type_ids=new.token_type_ids
        )
        self.pooling.add_request(request)
        self._arrivals[new.request_id] = arrival

    def abort(self, request_id: str) -> bool:
        self._arrivals.pop(request_id, None)
        return self.pooling.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.pooling.has_unfinished()

    def num_admissible(self, prompt_len: int, max_tokens: int = 16) -> int:
        """Room for about one more batch beyond what waits: requests leave in the step that
        runs them, so holding more only lengthens the queue inside the worker."""
        if prompt_len > self.max_model_len:
            return 0
        return max(0, self._max_num_seqs - self.pooling.num_waiting)

    def step(self) -> list[RequestDelta]:
        deltas = []
        now = time.monotonic()
        for result in self.pooling.step():
            arrival = self._arrivals.pop(result.request_id, now)
            metrics = RequestMetrics(arrival, arrival, now, now)
            choice = CompletionOutput(0, "", [], finish_reason="stop")
            output = RequestOutput(
                result.request_id,
                None,
                result.prompt_token_ids,
                [choice],
                metrics,
                finished=True,
                embedding=result.data.tolist(),
            )
            deltas.append(
                RequestDelta(result.request_id, 0, [], "", finish_reason="stop", output=output)
            )
        return deltas

    def stats(self) -> EngineStats:
        return EngineStats(
            num_blocks_total=0,
            num_blocks_free=0,
            num_blocks_cached=0,
            num_running=0,
            num_waiting=self.pooling.num_waiting,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_prompt_tokens_computed=self.pooling.num_prompt_tokens_computed,
            num_generation_tokens=0,
            num_preemptions=0,
            num_steps=self.pooling.num_steps,
        )
