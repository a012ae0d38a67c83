"""Batch API `/v1/embeddings` lines: an input file of embedding requests runs through the batch
controller and an in-process worker serving the shipped MiniLM; each output line's vector
equals sentence-transformers' own (lines run in groups, a job of many inputs each), a bad line
lands in the error file naming its field, and a line the worker refuses fails alone."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.errors import RequestRejectedError
from engine.model_files import ModelNotFoundError, resolve_model_path
from tests.batch.conftest import BatchStack
from worker.pooling_engine import PoolingWorkerEngine
from worker.settings import WorkerSettings
from worker.worker import Worker

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["Bulk indexing through a queue.", "Another line to embed", "x"]


def start_embedding_worker(stack: BatchStack) -> None:
    async def make() -> Worker:
        settings = WorkerSettings(
            name="embed-0",
            redis_url=stack.redis_url,
            model=MODEL,
            block_ms=50,
            heartbeat_interval_s=0.2,
            status_check_interval_s=0.2,
        )
        return Worker(settings, PoolingWorkerEngine(EngineConfig(model=MODEL)))

    worker = stack.bg.run(make(), timeout=120)
    stack._workers.append((worker, stack.bg.start(worker.run())))


def line(custom_id: str, body: dict[str, Any]) -> str:
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}
    )


def test_embedding_lines_equal_sentence_transformers(batch_stack: BatchStack) -> None:
    from sentence_transformers import SentenceTransformer

    try:
        path = resolve_model_path(MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    reference = torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(TEXTS))
    start_embedding_worker(batch_stack)
    batch_stack.start_controller()
    lines = [line(f"req-{i}", {"model": MODEL, "input": text}) for i, text in enumerate(TEXTS)]
    lines.append(line("bad", {"model": MODEL, "input": ""}))
    upload = batch_stack.upload("\n".join(lines) + "\n")
    created = batch_stack.create(upload["id"], endpoint="/v1/embeddings")
    done = batch_stack.wait(created["id"], {"completed", "failed"}, timeout=120)
    assert done["status"] == "completed", done
    outputs = {row["custom_id"]: row for row in batch_stack.content(done["output_file_id"])}
    for index, _text in enumerate(TEXTS):
        body = outputs[f"req-{index}"]["response"]["body"]
        vector = torch.tensor(body["data"][0]["embedding"])
        distance = 1 - F.cosine_similarity(vector.double(), reference[index].double(), dim=0)
        assert distance < 1e-5
        assert body["usage"]["prompt_tokens"] > 0
    (error,) = batch_stack.content(done["error_file_id"])
    assert error["custom_id"] == "bad"
    assert "input" in json.dumps(error["error"])


def _reference(texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    try:
        path = resolve_model_path(MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    return torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(texts))


def _distance(vector: list[float], reference: torch.Tensor) -> float:
    got = torch.tensor(vector).double()
    return float(1 - F.cosine_similarity(got, reference.double(), dim=0))


GROUPED_TEXTS = [
    f"Line {i}: " + "queues carry embedding work " * (1 + i % 5) + ("." if i % 2 else "")
    for i in range(150)
]


def test_grouped_embedding_lines_each_equal_sentence_transformers(batch_stack: BatchStack) -> None:
    """150 lines run as a few jobs of many inputs; each line's vector is still its own text's."""
    reference = _reference(GROUPED_TEXTS)
    start_embedding_worker(batch_stack)
    batch_stack.start_controller()
    lines = []
    for i, text in enumerate(GROUPED_TEXTS):
        body: dict[str, Any] = {"model": MODEL, "input": text}
        if 60 <= i < 70:
            body["dimensions"] = 64  # other pooling options: their own group
        if i % 3 == 0:
            body["encoding_format"] = "base64"
        lines.append(line(f"req-{i}", body))
    upload = batch_stack.upload("\n".join(lines) + "\n")
    created = batch_stack.create(upload["id"], endpoint="/v1/embeddings")
    done = batch_stack.wait(created["id"], {"completed", "failed"}, timeout=240)
    assert done["status"] == "completed", done
    rows = batch_stack.content(done["output_file_id"])
    assert sorted(row["custom_id"] for row in rows) == sorted(f"req-{i}" for i in range(150))
    assert len({row["id"] for row in rows}) == 150
    assert len({row["response"]["request_id"] for row in rows}) < 10  # a few jobs, not 150
    for row in rows:
        index = int(row["custom_id"][4:])
        body = row["response"]["body"]
        (item,) = body["data"]
        vector = item["embedding"]
        if index % 3 == 0:
            raw = base64.b64decode(vector)
            vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        expected = reference[index]
        if 60 <= index < 70:
            assert len(vector) == 64
            expected = F.normalize(expected[:64], dim=0)
        assert _distance(vector, expected) < 1e-5, row["custom_id"]
        assert body["usage"]["prompt_tokens"] > 0


class _RefusingEngine(PoolingWorkerEngine):
    """Refuses any input with `POISON` in it, as a worker refuses an input it cannot run."""

    def tokenize(self, text: str) -> list[int]:
        if "POISON" in text:
            raise RequestRejectedError("this input cannot be embedded")
        return super().tokenize(text)


def test_a_line_the_worker_refuses_fails_alone_and_its_group_runs(batch_stack: BatchStack) -> None:
    texts = [f"Text {i} for the grouped batch" for i in range(20)]
    texts[7] = "Text 7 POISON"
    reference = _reference(texts)

    async def make() -> Worker:
        settings = WorkerSettings(
            name="embed-refusing",
            redis_url=batch_stack.redis_url,
            model=MODEL,
            block_ms=50,
            heartbeat_interval_s=0.2,
            status_check_interval_s=0.2,
        )
        return Worker(settings, _RefusingEngine(EngineConfig(model=MODEL)))

    worker = batch_stack.bg.run(make(), timeout=120)
    batch_stack._workers.append((worker, batch_stack.bg.start(worker.run())))
    batch_stack.start_controller()
    lines = [line(f"req-{i}", {"model": MODEL, "input": text}) for i, text in enumerate(texts)]
    upload = batch_stack.upload("\n".join(lines) + "\n")
    created = batch_stack.create(upload["id"], endpoint="/v1/embeddings")
    done = batch_stack.wait(created["id"], {"completed", "failed"}, timeout=120)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 20, "completed": 19, "failed": 1}
    (error,) = batch_stack.content(done["error_file_id"])
    assert error["custom_id"] == "req-7"
    assert "cannot be embedded" in error["error"]["message"]
    for row in batch_stack.content(done["output_file_id"]):
        index = int(row["custom_id"][4:])
        (item,) = row["response"]["body"]["data"]
        assert _distance(item["embedding"], reference[index]) < 1e-5
