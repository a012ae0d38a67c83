"""The slice of `engine.Engine` a worker drives, and how a worker builds its engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from schemas.sampling import SamplingParams

if TYPE_CHECKING:
    from worker.settings import WorkerSettings


class EngineLike(Protocol):
    """What the worker calls on an engine (engine.Engine satisfies it; tests use fakes)."""

    max_model_len: int
    block_size: int

    def tokenize(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        prior_output_token_ids: list[list[int]] | None = None,
    ) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[Any]: ...

    def pop_output(self, request_id: str) -> Any: ...

    def has_unfinished(self) -> bool: ...

    def num_admissible(self, prompt_len: int, max_tokens: int = 16) -> int: ...

    def stats(self) -> Any: ...


def build_engine(settings: WorkerSettings) -> EngineLike:
    """The engine the settings describe: `engine_factory` if given, else `engine.Engine` with
    every engine setting passed through."""
    if settings.engine_factory:
        module_name, _, function_name = settings.engine_factory.partition(":")
        factory = getattr(importlib.import_module(module_name), function_name or "build_engine")
        return factory(settings)
    from engine import Engine

    return Engine(settings.engine_config())
