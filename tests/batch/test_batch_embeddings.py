"""Batch API `/v1/embeddings` lines: an input file of embedding requests runs through the batch
controller and an in-process worker serving the shipped MiniLM; each output line's vector
equals sentence-transformers' own, and a bad line lands in the error file naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
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
