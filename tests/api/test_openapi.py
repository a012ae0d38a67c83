"""The published OpenAPI document lists every status each route answers with, errors with the
one error body's schema; and every validation error names its field in `param`."""

from __future__ import annotations

import httpx
import pytest

from producer_api.app import create_app
from producer_api.settings import ApiSettings
from tests.api.conftest import MODEL, auth

ERROR_REF = "#/components/schemas/ErrorResponse"
GENERATION = {200, 400, 401, 404, 408, 409, 413, 429, 500, 503}

# Every operation and the statuses it answers with (success first).
STATUSES = {
    ("post", "/v1/jobs"): {202, 401, 404, 413, 422, 429, 503},
    ("get", "/v1/jobs/{job_id}"): {200, 401, 404, 503},
    ("delete", "/v1/jobs/{job_id}"): {200, 401, 404, 503},
    ("get", "/v1/jobs/{job_id}/wait"): {200, 401, 404, 422, 503},
    ("get", "/v1/jobs/{job_id}/stream"): {200, 401, 404, 422, 503},
    ("get", "/v1/models"): {200, 401, 503},
    ("get", "/v1/models/{model}"): {200, 401, 404, 503},
    ("post", "/v1/load_lora_adapter"): {200, 401, 403, 404, 422, 503},
    ("post", "/v1/unload_lora_adapter"): {200, 401, 403, 404, 422, 503},
    ("post", "/v1/completions"): GENERATION,
    ("post", "/v1/chat/completions"): GENERATION,
    ("post", "/v1/embeddings"): GENERATION,
    ("post", "/v1/score"): GENERATION,
    ("post", "/v1/rerank"): GENERATION,
    ("post", "/generate"): GENERATION,
    ("post", "/v1/files"): {200, 400, 401, 413, 503},
    ("get", "/v1/files"): {200, 400, 401, 503},
    ("delete", "/v1/files/{file_id}"): {200, 401, 404, 409, 503},
    ("get", "/v1/files/{file_id}"): {200, 401, 404, 503},
    ("get", "/v1/files/{file_id}/content"): {200, 401, 404, 503},
    ("post", "/v1/batches"): {200, 400, 401, 413, 503},
    ("get", "/v1/batches"): {200, 400, 401, 503},
    ("get", "/v1/batches/{batch_id}"): {200, 401, 404, 503},
    ("post", "/v1/batches/{batch_id}/cancel"): {200, 401, 404, 409, 413, 503},
    ("get", "/health"): {200},
    ("get", "/ready"): {200, 503},
    ("get", "/metrics"): {200},
    ("get", "/dashboard"): {200},
    ("get", "/dashboard/data"): {200, 503},
    ("post", "/tokenize"): {200, 400, 401, 404, 503},
    ("post", "/detokenize"): {200, 400, 401, 404, 503},
    ("get", "/version"): {200},
}
# Errors whose body is not the error body: /ready answers its readiness report either way.
OWN_BODIES = {("get", "/ready", 503): "#/components/schemas/Readiness"}


@pytest.fixture(scope="module")
def document() -> dict:
    return create_app(ApiSettings(auth_disabled=True)).openapi()


def test_every_route_documents_every_status_it_answers(document):
    operations = {
        (method, path): {int(status) for status in operation["responses"]}
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
    }
    assert operations == STATUSES


def test_every_error_status_has_the_error_body_schema(document):
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            for status, response in operation["responses"].items():
                if int(status) < 400:
                    continue
                schema = response["content"]["application/json"]["schema"]
                want = OWN_BODIES.get((method, path, int(status)), ERROR_REF)
                assert schema == {"$ref": want}, (method, path, status)
                assert response["description"], (method, path, status)
                if int(status) in (429, 503) and (method, path, 503) not in OWN_BODIES:
                    assert "Retry-After" in response["headers"], (method, path, status)
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # FastAPI's body, which this API never sends
    detail = schemas["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}
    assert schemas["ErrorResponse"]["required"] == ["error"]


JOB = {"model": MODEL, "prompt": "hi"}


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"{not json", "body"),
        (b"[1, 2]", "body"),
        (b"", "body"),
        ({"model": MODEL}, "prompt"),
        ({**JOB, "messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({**JOB, "timeout_s": 5, "deadline": "2999-01-01T00:00:00Z"}, "timeout_s"),
        ({**JOB, "sampling": {"min_tokens": 9, "max_tokens": 2}}, "sampling.min_tokens"),
        ({**JOB, "sampling": {"top_logprobs": 2}}, "sampling.top_logprobs"),
    ],
)
def test_jobs_validation_errors_name_the_field(stack, content, param):
    api = stack.api()
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        if isinstance(content, bytes):
            headers = {"Content-Type": "application/json"}
            response = http.post("/v1/jobs", content=content, headers=headers)
        else:
            response = http.post("/v1/jobs", json=content)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param), error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
        ("/v1/batches", {"endpoint": "/v1/completions"}, "input_file_id"),
    ],
)  # fmt: skip
def test_openai_validation_errors_name_the_field(stack, path, body, param):
    api = stack.api()
    stack.heartbeat()
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        response = http.post(path, json=body)
        not_json = http.post(path, content=b"{", headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert not_json.status_code == 400 and not_json.json()["error"]["param"] == "body"


def test_a_body_too_large_names_the_body(stack):
    api = stack.api(max_body_bytes=1024)
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        response = http.post("/v1/jobs", json={**JOB, "prompt": "x" * 2000})
    assert response.status_code == 413
    assert response.json()["error"]["param"] == "body"
