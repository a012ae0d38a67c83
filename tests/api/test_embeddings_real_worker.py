"""POST /v1/embeddings against the real system: uvicorn, a real Redis and a real worker process
(`inferq worker`) on the shipped MiniLM, driven by the official `openai` package. The vectors
must equal sentence-transformers' own; bad inputs are refused with a 400 naming the field
before anything is queued."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from redis import Redis

from producer_api.grpc.stubs import inference_pb2 as pb
from schemas import RedisKeys
from tests.api.conftest import ALICE_KEY, Stack, auth
from tests.api.grpc_stack import GrpcClient, grpc_server, metadata, trailing
from tests.api.real_worker import real_worker_stack

MODEL = "all-MiniLM-L6-v2"
GENERATOR = "some-generator"  # only a heartbeat: a generation model's live worker
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Queues never lose a line.", "a"]
READY_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    from engine.model_files import ModelNotFoundError, resolve_model_path

    try:
        path = resolve_model_path(MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    return torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(TEXTS))


@pytest.fixture(scope="module")
def system(tmp_path_factory, reference) -> Iterator[Stack]:
    with real_worker_stack(
        tmp_path_factory, MODEL, threads="1", ready_timeout_s=READY_TIMEOUT_S
    ) as stack:
        stack.heartbeat(GENERATOR)
        yield stack


@pytest.fixture
def http(system: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=system.servers[0].url, headers=auth(), timeout=120) as client:
        yield client


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 1 - F.cosine_similarity(a.double(), b.double(), dim=-1)


def test_openai_client_embeddings_equal_sentence_transformers(system, reference) -> None:
    with openai.OpenAI(
        base_url=system.servers[0].url + "/v1", api_key=ALICE_KEY, max_retries=0, timeout=120
    ) as sdk:
        response = sdk.embeddings.create(model=MODEL, input=TEXTS)  # base64 on the wire
        alone = sdk.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    ours = torch.tensor([item.embedding for item in response.data])
    assert [item.index for item in response.data] == [0, 1, 2]
    assert cosine_distance(ours, reference).max() < 1e-5
    assert cosine_distance(torch.tensor(alone.data[0].embedding), reference[1]) < 1e-5
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)


def test_float_base64_token_ids_and_dimensions(http: httpx.Client, reference) -> None:
    from transformers import AutoTokenizer

    from engine.model_files import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MODEL))
    ids = [tokenizer.encode(text) for text in TEXTS[:2]]
    body = {"model": MODEL, "input": ids, "encoding_format": "float"}
    floats = http.post("/v1/embeddings", json=body).json()
    vectors = torch.tensor([item["embedding"] for item in floats["data"]])
    assert cosine_distance(vectors, reference[:2]).max() < 1e-5
    assert floats["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    packed = http.post(
        "/v1/embeddings", json={**body, "encoding_format": "base64", "dimensions": 32}
    ).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    short = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert short.shape == (32,)
    assert cosine_distance(short, F.normalize(reference[0][:32], dim=0)) < 1e-5


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ["fine", ""]}, "input.1", "empty"),
        ({"input": []}, "input", "at least one"),
        ({"input": "word " * 600}, "input", "at most 256"),
        ({"input": "hi", "dimensions": 385}, "dimensions", "384"),
        ({"input": [[1, 2], [40000]]}, "input.1.0", "vocabulary"),
    ],
)
def test_bad_inputs_are_refused_before_queueing(
    system: Stack, http: httpx.Client, body: dict, param: str, words: str
) -> None:
    redis = Redis.from_url(system.redis_url)
    queued = redis.xlen(RedisKeys().jobs_stream(MODEL))
    response = http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert redis.xlen(RedisKeys().jobs_stream(MODEL)) == queued
    redis.close()


def test_a_list_of_inputs_is_one_job(system: Stack, http: httpx.Client, reference) -> None:
    redis = Redis.from_url(system.redis_url)
    pattern = RedisKeys().job_key_prefix() + "*"
    before = set(redis.scan_iter(match=pattern))
    response = http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS})
    assert response.status_code == 200, response.text
    assert len(set(redis.scan_iter(match=pattern)) - before) == 1
    redis.close()
    ours = torch.tensor([item["embedding"] for item in response.json()["data"]])
    assert cosine_distance(ours, reference).max() < 1e-5


def test_wrong_task_is_refused_naming_it(http: httpx.Client) -> None:
    generate = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert generate.status_code == 400
    assert generate.json()["error"]["param"] == "model"
    assert "serves embedding jobs, not generation" in generate.json()["error"]["message"]
    embed = http.post("/v1/embeddings", json={"model": GENERATOR, "input": "hi"})
    assert embed.status_code == 400
    assert "serves generation jobs, not embedding" in embed.json()["error"]["message"]


def test_jobs_api_embedding_job(http: httpx.Client, reference) -> None:
    created = http.post("/v1/jobs", json={"model": MODEL, "prompt": TEXTS[0], "pooling": {}})
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    done = http.get(f"/v1/jobs/{job_id}/wait", params={"timeout": 60}).json()
    assert done["status"] == "succeeded"
    vector = torch.tensor(done["result"]["embedding"])
    assert cosine_distance(vector, reference[0]) < 1e-5


def test_jobs_api_embedding_job_of_several_inputs(http: httpx.Client, reference) -> None:
    """One job, a vector per input in input order, each the one its text alone would get."""
    created = http.post("/v1/jobs", json={"model": MODEL, "inputs": TEXTS, "pooling": {}})
    assert created.status_code == 202, created.text
    done = http.get(f"/v1/jobs/{created.json()['id']}/wait", params={"timeout": 60}).json()
    assert done["status"] == "succeeded", done
    result = done["result"]
    vectors = torch.tensor(result["embeddings"])
    assert cosine_distance(vectors, reference).max() < 1e-5
    assert len(result["input_tokens"]) == len(TEXTS)
    assert sum(result["input_tokens"]) == result["usage"]["prompt_tokens"]
    outside = http.post(
        "/v1/jobs", json={"model": MODEL, "inputs": [TEXTS[0], [101, 10**7]], "pooling": {}}
    )
    # the jobs API's status for a refused prompt, as for a job of one input
    assert outside.status_code == 422
    assert outside.json()["error"]["code"] == "invalid_token_id"
    assert outside.json()["error"]["param"] == "inputs.1.1"


@pytest.mark.parametrize("transport", ["http", "redis"])
def test_python_client_embed(system: Stack, reference, transport: str) -> None:
    from producer_api.client import Client, QueueError

    url = system.servers[0].url if transport == "http" else system.redis_url
    with Client(url, api_key=ALICE_KEY) as client:
        vectors = torch.tensor(client.embed(MODEL, TEXTS, timeout=60))
        assert cosine_distance(vectors, reference).max() < 1e-5
        (short,) = client.embed(MODEL, TEXTS[0], dimensions=16, timeout=60)
        assert len(short) == 16
        if transport == "redis":  # straight into the queue: the worker refuses it
            with pytest.raises(QueueError, match="at most 256"):
                client.embed(MODEL, "word " * 600, timeout=60)


def test_score_and_rerank_are_cosines_of_the_embeddings(http: httpx.Client, reference) -> None:
    scored = http.post(
        "/v1/score", json={"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]}
    ).json()
    expected = F.cosine_similarity(reference[0:1], reference[1:])
    got = torch.tensor([item["score"] for item in scored["data"]])
    assert torch.allclose(got, expected, atol=1e-5)
    assert scored["usage"]["prompt_tokens"] > 0
    reranked = http.post(
        "/v1/rerank",
        json={"model": MODEL, "query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1},
    ).json()
    (best,) = reranked["results"]
    assert best["index"] == int(expected.argmax())
    assert best["document"]["text"] == TEXTS[1 + best["index"]]
    assert abs(best["relevance_score"] - expected.max().item()) < 1e-5
    bad = http.post("/v1/score", json={"model": MODEL, "text_1": ["a", "b"], "text_2": ["c"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    empty = http.post("/v1/rerank", json={"model": MODEL, "query": "q", "documents": ["d", ""]})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents.1"


# ---- gRPC ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpc_client(system: Stack) -> Iterator[GrpcClient]:
    with grpc_server(system, models=[]) as client:
        yield client


def test_grpc_embeddings_equal_sentence_transformers(grpc_client: GrpcClient, reference) -> None:
    from transformers import AutoTokenizer

    from engine.model_files import resolve_model_path

    reply = grpc_client.stub.CreateEmbedding(
        pb.EmbeddingRequest(model_id=MODEL, input=TEXTS), metadata=metadata(), timeout=120
    )
    ours = torch.tensor([list(item.embedding) for item in reply.data])
    assert [item.index for item in reply.data] == [0, 1, 2] and reply.model_id == MODEL
    assert cosine_distance(ours, reference).max() < 1e-5
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MODEL))
    ids = [tokenizer.encode(text) for text in TEXTS[:2]]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens
    assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    by_ids = grpc_client.stub.CreateEmbedding(
        pb.EmbeddingRequest(
            model_id=MODEL, input_token_ids=[pb.TokenIds(token_ids=i) for i in ids], dimensions=32
        ),
        metadata=metadata(),
        timeout=120,
    )
    short = torch.tensor([list(item.embedding) for item in by_ids.data])
    assert short.shape == (2, 32)
    expected = F.normalize(reference[:2, :32], dim=-1)
    assert cosine_distance(short, expected).max() < 1e-5
    job = grpc_client.stub.GetJob(
        pb.GetJobRequest(job_id=reply.data[0].job_id), metadata=metadata()
    )
    # The request's three inputs ran as one job, which holds each input's vector.
    assert {item.job_id for item in reply.data} == {reply.data[0].job_id}
    assert job.status == "succeeded" and not job.embedding
    assert [list(e.embedding) for e in job.embeddings] == [list(i.embedding) for i in reply.data]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"input": ["fine", ""]}, "input.1", "empty"),
        ({}, "input", "at least one"),
        ({"input": ["word " * 600]}, "input.0", "at most 256"),
        ({"input": ["hi"], "dimensions": 385}, "dimensions", "384"),
        ({"input": ["hi"], "dimensions": 0}, "dimensions", "at least 1"),
        (
            {"input": ["hi"], "input_token_ids": [pb.TokenIds(token_ids=[1])]},
            "input_token_ids",
            "not both",
        ),
        (
            {"input_token_ids": [pb.TokenIds(token_ids=[1, 2]), pb.TokenIds(token_ids=[40000])]},
            "input_token_ids.1.0",
            "vocabulary",
        ),
        ({"model_id": GENERATOR, "input": ["hi"]}, "model_id", "not embedding"),
    ],
)
def test_grpc_bad_embedding_inputs_are_invalid_argument_before_queueing(
    system: Stack, grpc_client: GrpcClient, fields: dict, param: str, words: str
) -> None:
    redis = Redis.from_url(system.redis_url)
    queued = redis.xlen(RedisKeys().jobs_stream(MODEL))
    with pytest.raises(grpc.RpcError) as failed:
        grpc_client.stub.CreateEmbedding(
            pb.EmbeddingRequest(**{"model_id": MODEL, **fields}), metadata=metadata(), timeout=60
        )
    assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT, failed.value.details()
    assert trailing(failed.value)["error-param"] == param
    assert words in failed.value.details()
    assert redis.xlen(RedisKeys().jobs_stream(MODEL)) == queued
    redis.close()
