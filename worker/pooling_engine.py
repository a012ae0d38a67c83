"""A pooling engine (embeddings) behind the slice of the engine a worker drives (EngineLike):
an embedding job goes in as an EngineRequest with pooling params, and comes out in the step
that runs it as one finishing delta whose output carries the vector. No KV cache is held
between steps, so the heartbeat reports no blocks and admission counts waiting requests.

A job of several inputs goes in as one pooling request per input (the engine packs them into
its batches like any others) and comes out as one finishing delta once its last input is
pooled, with every vector in input order."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.errors import DuplicateRequestError, RequestRejectedError
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
from schemas.pooling import PoolingParams


@dataclass
class _Inputs:
    """The inputs of one request of several, as they are pooled."""

    vectors: list[list[float] | None]
    token_counts: list[int]
    left: int


def input_request_id(request_id: str, index: int) -> str:
    """The pooling engine's id of input `index` of the request `request_id`."""
    return f"{request_id}/{index}"


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
        self._inputs: dict[str, _Inputs] = {}  # the requests of several inputs, by id
        self._input_of: dict[str, tuple[str, int]] = {}  # an input's id -> (request id, index)
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
        if new.inputs is not None:
            self._add_inputs(new.request_id, new.inputs, new.pooling, arrival)
        else:
            request = PoolingRequest(
                new.request_id, new.prompt, new.pooling, arrival, token_type_ids=new.token_type_ids
            )
            self.pooling.add_request(request)
        self._arrivals[new.request_id] = arrival

    def _add_inputs(
        self, request_id: str, inputs: list[list[int]], params: PoolingParams, arrival: float
    ) -> None:
        """Each input as a pooling request of its own; all or none (an input the engine
        refuses refuses the request, naming the input)."""
        if request_id in self._inputs:
            raise DuplicateRequestError(f"request {request_id!r} is already running")
        if not inputs:
            raise RequestRejectedError("the request has no input")
        added: list[str] = []
        try:
            for index, token_ids in enumerate(inputs):
                input_id = input_request_id(request_id, index)
                self.pooling.add_request(PoolingRequest(input_id, token_ids, params, arrival))
                added.append(input_id)
        except RequestRejectedError as exc:
            for input_id in added:
                self.pooling.abort(input_id)
            refused = type(exc)(f"inputs.{len(added)}: {exc}")
            raise refused from exc
        except Exception:
            for input_id in added:
                self.pooling.abort(input_id)
            raise
        self._inputs[request_id] = _Inputs([None] * len(inputs), [0] * len(inputs), len(inputs))
        for index, input_id in enumerate(added):
            self._input_of[input_id] = (request_id, index)

    def abort(self, request_id: str) -> bool:
        self._arrivals.pop(request_id, None)
        inputs = self._inputs.pop(request_id, None)
        if inputs is None:
            return self.pooling.abort(request_id)
        aborted = False
        for index in range(len(inputs.vectors)):
            input_id = input_request_id(request_id, index)
            self._input_of.pop(input_id, None)
            aborted = self.pooling.abort(input_id) or aborted
        return aborted

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
            owner = self._input_of.pop(result.request_id, None)
            if owner is not None:
                delta = self._input_pooled(owner, result.prompt_token_ids, result.data, now)
                if delta is not None:
                    deltas.append(delta)
                continue
            output = self._output(result.request_id, result.prompt_token_ids, now)
            output.embedding = result.data.tolist()
            deltas.append(_finishing(output))
        return deltas

    def _input_pooled(
        self, owner: tuple[str, int], token_ids: list[int], data: torch.Tensor, now: float
    ) -> RequestDelta | None:
        """Note one input's vector; the request's finishing delta once it was the last."""
        request_id, index = owner
        inputs = self._inputs[request_id]
        inputs.vectors[index] = data.tolist()
        inputs.token_counts[index] = len(token_ids)
        inputs.left -= 1
        if inputs.left:
            return None
        del self._inputs[request_id]
        output = self._output(request_id, [], now)
        output.embeddings = [v for v in inputs.vectors if v is not None]
        output.input_token_counts = inputs.token_counts
        return _finishing(output)

    def _output(self, request_id: str, token_ids: list[int], now: float) -> RequestOutput:
        arrival = self._arrivals.pop(request_id, now)
        metrics = RequestMetrics(arrival, arrival, now, now)
        choice = CompletionOutput(0, "", [], finish_reason="stop")
        return RequestOutput(request_id, None, token_ids, [choice], metrics, finished=True)

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


def _finishing(output: RequestOutput) -> RequestDelta:
    return RequestDelta(output.request_id, 0, [], "", finish_reason="stop", output=output)
