"""The real engine with a test-only poison: a step that runs a request whose prompt is
`INFERQ_TEST_POISON_PROMPT` ends this process at once (`os._exit(POISON_EXIT)`), the way a
request that crashes its worker would. For worker subprocesses:
`INFERQ_ENGINE_FACTORY=poison_engine:build_engine`, with this folder on PYTHONPATH."""

from __future__ import annotations

import os

from engine import Engine
from engine.outputs import EngineRequest, RequestDelta
from worker.settings import WorkerSettings

POISON_PROMPT_ENV = "INFERQ_TEST_POISON_PROMPT"
POISON_EXIT = 86


class PoisonedEngine(Engine):
    def __init__(self, settings: WorkerSettings, poison_prompt: str) -> None:
        super().__init__(settings.engine_config())
        self._poison_ids = self.tokenize(poison_prompt)
        self._poisoned: set[str] = set()

    def add_request(self, new: EngineRequest) -> None:
        super().add_request(new)
        if new.prompt == self._poison_ids:
            self._poisoned.add(new.request_id)

    def abort(self, request_id: str) -> bool:
        self._poisoned.discard(request_id)
        return super().abort(request_id)

    def step(self) -> list[RequestDelta]:
        if self._poisoned:
            os._exit(POISON_EXIT)
        return super().step()


def build_engine(settings: WorkerSettings) -> PoisonedEngine:
    return PoisonedEngine(settings, os.environ[POISON_PROMPT_ENV])
