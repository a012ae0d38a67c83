"""An embedding job's vector in the job hash: packed as float32 bytes where float32 holds every
value, read back as exactly the floats the worker stored, wider vectors kept as they are."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import torch
from pydantic import ValidationError

from schemas import ChoiceResult, Job, JobRequest, JobResult, JobStatus, Timings, Usage
from schemas.pooling import PoolingParams
from schemas.vectors import PACKED_EMBEDDING_FIELD, PACKED_EMBEDDINGS_FIELD

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def _stored_job(embedding: list[float]) -> tuple[Job, dict[str, str]]:
    request = JobRequest(model="m", prompt="a text", pooling=PoolingParams())
    result = JobResult(
        choices=[ChoiceResult(index=0, text="", token_ids=[], finish_reason="stop")],
        usage=Usage.of(3, 0, 0),
        timings=Timings.from_times(T0, T0, None, T0),
        embedding=embedding,
    )
    job = Job(id="job_" + "j" * 20, request=request, created_at=T0, status=JobStatus.SUCCEEDED)
    job = job.model_copy(update={"result": result})
    return job, job.to_redis_hash()


def test_a_float32_vector_is_stored_packed_and_read_back_exactly() -> None:
    vector = torch.randn(384, generator=torch.Generator().manual_seed(0)).tolist()
    vector[:3] = torch.tensor([1e-30, -3.0517578125e-05, 0.0]).tolist()  # tiny and exact too
    job, stored = _stored_job(vector)
    assert PACKED_EMBEDDING_FIELD in json.loads(stored["result"])
    plain = job.result.model_dump_json(exclude_none=True)  # type: ignore[union-attr]
    assert len(stored["result"]) < len(plain) / 2
    read = Job.from_redis_hash(stored)
    assert read.result is not None and read.result.embedding == vector
    assert read == job


def test_a_vector_float32_cannot_hold_stays_floats() -> None:
    vector = [0.1, 1e300, -2.5]  # 0.1 and 1e300 are no float32 values
    _, stored = _stored_job(vector)
    assert json.loads(stored["result"])["embedding"] == vector
    read = Job.from_redis_hash(stored)
    assert read.result is not None and read.result.embedding == vector


def test_a_damaged_packing_fails_naming_the_field() -> None:
    _, stored = _stored_job([0.5, 0.25])
    result = json.loads(stored["result"])
    result[PACKED_EMBEDDING_FIELD] = "not base64!"
    with pytest.raises(ValidationError, match=PACKED_EMBEDDING_FIELD):
        Job.from_redis_hash({**stored, "result": json.dumps(result)})


def _stored_inputs_job(vectors: list[list[float]]) -> tuple[Job, dict[str, str]]:
    inputs: list[str | list[int]] = ["a text", [101, 7, 102]][: len(vectors)]
    request = JobRequest(model="m", inputs=inputs, pooling=PoolingParams())
    result = JobResult(
        choices=[ChoiceResult(index=0, text="", token_ids=[], finish_reason="stop")],
        usage=Usage.of(7, 0, 0),
        timings=Timings.from_times(T0, T0, None, T0),
        embeddings=vectors,
        input_tokens=[4, 3][: len(vectors)],
    )
    job = Job(id="job_" + "k" * 20, request=request, created_at=T0, status=JobStatus.SUCCEEDED)
    job = job.model_copy(update={"result": result})
    return job, job.to_redis_hash()


def test_a_job_of_several_inputs_stores_each_vector_packed_and_reads_them_back_in_order() -> None:
    generator = torch.Generator().manual_seed(1)
    vectors = [torch.randn(384, generator=generator).tolist() for _ in range(2)]
    job, stored = _stored_inputs_job(vectors)
    assert PACKED_EMBEDDINGS_FIELD in json.loads(stored["result"])
    read = Job.from_redis_hash(stored)
    assert read.result is not None and read.result.embeddings == vectors
    assert read.result.input_tokens == [4, 3]
    assert read == job


def test_several_vectors_float32_cannot_hold_stay_floats() -> None:
    vectors = [[0.5, -2.0], [0.1, 1e300]]
    _, stored = _stored_inputs_job(vectors)
    assert json.loads(stored["result"])["embeddings"] == vectors
    assert Job.from_redis_hash(stored).result.embeddings == vectors  # type: ignore[union-attr]


def test_inputs_make_an_embedding_job_only() -> None:
    with pytest.raises(ValidationError, match="inputs"):
        JobRequest(model="m", inputs=["a", "b"])  # no pooling: not an embedding job
    with pytest.raises(ValidationError, match="exactly one"):
        JobRequest(model="m", inputs=["a"], prompt="b", pooling=PoolingParams())
    with pytest.raises(ValidationError):
        JobRequest(model="m", inputs=["a", ""], pooling=PoolingParams())  # an empty input
    request = JobRequest(model="m", inputs=["a", [1, 2]], pooling=PoolingParams())
    assert request.input_count == 2 and request.input_kind == "inputs"


def test_a_result_needs_one_token_count_per_vector() -> None:
    with pytest.raises(ValidationError, match="input_tokens"):
        JobResult(
            choices=[ChoiceResult(index=0, text="", token_ids=[], finish_reason="stop")],
            usage=Usage.of(3, 0, 0),
            timings=Timings.from_times(T0, T0, None, T0),
            embeddings=[[0.5], [0.25]],
            input_tokens=[3],
        )
