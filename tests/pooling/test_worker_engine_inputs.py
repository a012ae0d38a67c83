"""A worker's pooling engine runs a job of several inputs as one pooling sequence per input and
finishes it once, when the last is pooled, with every vector in input order (each the vector
its input alone gets); an input it refuses refuses the job, naming the input, and nothing of
it stays queued; an abort takes every input out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ContextLengthExceededError
from engine.outputs import EngineRequest, RequestOutput
from schemas import SamplingParams
from schemas.pooling import PoolingParams
from worker.pooling_engine import PoolingWorkerEngine

TEXTS = ["a queue of texts", "embedding work", "x", "one more line to embed, a longer one"]


@pytest.fixture(scope="module")
def engine(minilm_path: Path) -> PoolingWorkerEngine:
    return PoolingWorkerEngine(EngineConfig(model=str(minilm_path), max_num_seqs=3))


def _request(request_id: str, inputs: list[list[int]]) -> EngineRequest:
    return EngineRequest(request_id, [], SamplingParams(), pooling=PoolingParams(), inputs=inputs)


def _run(engine: PoolingWorkerEngine) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.output is not None and delta.request_id not in finished
            finished[delta.request_id] = delta.output
    return finished


def test_a_job_of_several_inputs_finishes_once_with_each_inputs_own_vector(
    engine: PoolingWorkerEngine,
) -> None:
    ids = [engine.tokenize(text) for text in TEXTS]
    for index, token_ids in enumerate(ids):
        engine.add_request(EngineRequest(f"alone-{index}", token_ids, SamplingParams(),
                                         pooling=PoolingParams()))  # fmt: skip
    alone = _run(engine)
    engine.add_request(_request("group", ids))  # more inputs than one step's max_num_seqs
    (output,) = _run(engine).values()
    assert output.request_id == "group" and output.embeddings is not None
    assert output.input_token_counts == [len(token_ids) for token_ids in ids]
    for index, vector in enumerate(output.embeddings):
        expected = torch.tensor(alone[f"alone-{index}"].embedding)
        assert torch.allclose(torch.tensor(vector), expected, atol=1e-5)


def test_an_input_the_engine_refuses_refuses_the_job_and_leaves_nothing_queued(
    engine: PoolingWorkerEngine,
) -> None:
    too_long = [101] * (engine.max_model_len + 1)
    with pytest.raises(ContextLengthExceededError, match=r"inputs\.1"):
        engine.add_request(_request("refused", [engine.tokenize("fine"), too_long]))
    assert not engine.has_unfinished()
    engine.add_request(_request("refused", [engine.tokenize("fine")]))  # its id is free again
    assert list(_run(engine)) == ["refused"]


def test_an_abort_takes_every_input_out(engine: PoolingWorkerEngine) -> None:
    engine.add_request(_request("aborted", [engine.tokenize(text) for text in TEXTS]))
    engine.step()  # some inputs pooled, the rest waiting
    assert engine.abort("aborted")
    assert not engine.has_unfinished()
    assert _run(engine) == {}
