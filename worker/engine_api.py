"""The slice of `engine.Engine` a worker drives, and how a worker builds its engine."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from engine.outputs import EngineRequest, EngineStats, RequestDelta
from schemas.jobs import JobKind

if TYPE_CHECKING:
    from worker.settings import WorkerSettings


class EngineLike(Protocol):
    """What the worker calls on an engine (engine.Engine satisfies it; tests use fakes).

    A finished request's output comes only on the delta that finishes it (`delta.output`).
    `vocab_size`, `max_model_len` and `tokenizer_file` go into the heartbeat, so the API refuses
    what the engine would refuse before it is queued; `quantization`, `weight_bytes` and
    `architecture` too, so operators see what each worker runs."""

    max_model_len: int
    block_size: int
    vocab_size: int
    tokenizer_file: Path | None  # the model's tokenizer.json; None without a tokenizer
    quantization: str | None  # the weight quantization in use; None: full precision
    weight_bytes: int  # bytes the loaded weights take
    architecture: str | None  # the architecture the model is served as; None: unknown
    task: JobKind  # the one kind of job it runs (advertised, so the API refuses the other)
    embedding_size: int | None  # an embedding engine's vector size; None for generation

    def tokenize(self, text: str) -> list[int]: ...

    def tokenize_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A text pair as one input: (token ids, token type ids)."""
        ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...

    def add_request(self, new: EngineRequest) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[RequestDelta]: ...

    def has_unfinished(self) -> bool: ...

    def num_admissible(self, prompt_len: int, max_tokens: int = 16) -> int: ...

    def stats(self) -> EngineStats: ...


def build_engine(settings: WorkerSettings) -> EngineLike:
    """The engine the settings describe: `engine_factory` if given, else `engine.Engine` with
    every engine setting passed through."""
    if settings.engine_factory:
        module_name, _, function_name = settings.engine_factory.partition(":")
        factory = getattr(importlib.import_module(module_name), function_name or "build_engine")
        return factory(settings)
    from engine import Engine
    from engine.pooling_llm import pooling_config

    config = settings.engine_config()
    if pooling_config(config, task=None):
        from worker.pooling_engine import PoolingWorkerEngine

        return PoolingWorkerEngine(config)
    return Engine(config)
