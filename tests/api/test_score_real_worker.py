"""POST /v1/score and /v1/rerank on a cross-encoder through the queue: a real worker process
serving a tiny random BertForSequenceClassification takes score jobs (text pairs) and the
scores equal the sigmoid of transformers' logits; the other routes refuse it naming the task."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.api.conftest import Stack, auth
from tests.api.real_worker import real_worker_stack

NAME = "tiny-cross-encoder"
QUERY = "what is a queue"
DOCUMENTS = ["A queue holds jobs until a worker takes them.", "Bananas are yellow.", "queues"]
READY_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Path:
    import transformers as tf

    from engine.model_files import ModelNotFoundError, resolve_model_path

    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    config = tf.BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=1,
    )
    model = tf.BertForSequenceClassification(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    path = tmp_path_factory.mktemp("models") / "cross"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def system(tmp_path_factory, cross_encoder: Path) -> Iterator[Stack]:
    with real_worker_stack(
        tmp_path_factory,
        str(cross_encoder),
        "--served-model-name",
        NAME,
        threads="1",
        ready_timeout_s=READY_TIMEOUT_S,
    ) as stack:
        yield stack


def reference_scores(path: Path, queries: list[str], documents: list[str]) -> torch.Tensor:
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    model = tf.BertForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        batch = tokenizer(queries, documents, padding=True, return_tensors="pt")
        return torch.sigmoid(model(**batch).logits[:, 0])


def test_score_and_rerank_equal_transformers(system: Stack, cross_encoder: Path) -> None:
    expected = reference_scores(cross_encoder, [QUERY] * len(DOCUMENTS), DOCUMENTS)
    with httpx.Client(base_url=system.servers[0].url, headers=auth(), timeout=120) as http:
        scored = http.post("/v1/score", json={"model": NAME, "text_1": QUERY, "text_2": DOCUMENTS})
        assert scored.status_code == 200, scored.text
        got = torch.tensor([item["score"] for item in scored.json()["data"]])
        assert torch.allclose(got, expected, atol=1e-5)
        reranked = http.post(
            "/v1/rerank", json={"model": NAME, "query": QUERY, "documents": DOCUMENTS}
        ).json()["results"]
        assert [r["index"] for r in reranked] == expected.argsort(descending=True).tolist()
        embed = http.post("/v1/embeddings", json={"model": NAME, "input": "hi"})
        assert embed.status_code == 400
        assert "serves score jobs, not embedding" in embed.json()["error"]["message"]
        job = http.post(
            "/v1/jobs", json={"model": NAME, "prompt": QUERY, "prompt_pair": "x", "pooling": {}}
        )
        assert job.status_code == 202, job.text
