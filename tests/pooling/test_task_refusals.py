"""Each engine refuses the other kind of job, naming what it serves: the worker fails such a
job with the engine's reason (the API refuses it earlier, from the heartbeat's task)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import RequestRejectedError
from engine.outputs import EngineRequest
from schemas import JobKind
from schemas.pooling import PoolingParams
from schemas.sampling import SamplingParams
from tests.pooling.conftest import save_tiny_qwen3
from worker.pooling_engine import PoolingWorkerEngine


def test_generating_engine_refuses_embedding_requests(tmp_path: Path) -> None:
    path = save_tiny_qwen3(tmp_path / "qwen3", bare=False)
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=8, enforce_eager=True))
    assert engine.task is JobKind.GENERATION and engine.embedding_size is None
    request = EngineRequest("r1", [1, 2, 3], SamplingParams(), pooling=PoolingParams())
    with pytest.raises(RequestRejectedError, match="need an embedding model"):
        engine.add_request(request)
    assert not engine.has_unfinished()


def test_embedding_engine_refuses_generation_and_pairs(minilm_path: Path) -> None:
    engine = PoolingWorkerEngine(EngineConfig(model=str(minilm_path)))
    assert engine.task is JobKind.EMBEDDING and engine.embedding_size == 384
    with pytest.raises(RequestRejectedError, match="serves embedding jobs; generation needs"):
        engine.add_request(EngineRequest("g", [101, 102], SamplingParams()))
    with pytest.raises(RequestRejectedError, match="text pairs need a cross-encoder"):
        engine.tokenize_pair("a", "b")
    engine.add_request(
        EngineRequest("e", [101, 7592, 102], SamplingParams(), pooling=PoolingParams())
    )
    (delta,) = engine.step()
    assert delta.output is not None and len(delta.output.embedding or []) == 384
    assert engine.stats().num_prompt_tokens_computed == 3
