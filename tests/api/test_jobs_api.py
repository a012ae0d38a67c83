"""The jobs API over real HTTP (uvicorn), real Redis and the echo worker."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from producer_api.client.http_client import SseParser
from schemas import JobRequest
from tests.api.conftest import ALICE_KEY, BOB_KEY, MODEL, auth
from tests.api.echo_worker import echo_output

PROMPT = "one two three four five six seven eight"


def job_body(prompt: str = PROMPT, **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "stream": True, **fields}


def sse_events(source: httpx.Response | Iterator[str], limit: int | None = None) -> list:
    """Events read from a response (or from its line iterator: pass one to keep reading the
    same connection later; a dropped line iterator closes the connection)."""
    lines = source.iter_lines() if isinstance(source, httpx.Response) else source
    parser, events = SseParser(), []
    for line in lines:
        event = parser.feed(line)
        if event is not None:
            events.append(event)
            if limit is not None and len(events) >= limit:
                break
    return events


def test_create_poll_and_finish(stack):
    api = stack.api()
    stack.worker()
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        created = http.post("/v1/jobs", json=job_body(sampling={"max_tokens": 5}))
        assert created.status_code == 202, created.text
        job = created.json()
        assert job["status"] in ("queued", "running", "succeeded")
        assert created.headers["Location"] == job["links"]["self"] == f"/v1/jobs/{job['id']}"
        assert set(job["links"]) == {"self", "stream", "wait", "cancel"}
        done = http.get(f"/v1/jobs/{job['id']}/wait", params={"timeout": 10}).json()
        assert done["status"] == "succeeded"
        expected = echo_output(JobRequest.model_validate(job_body(sampling={"max_tokens": 5})))
        assert done["result"]["choices"][0]["text"] == expected.text
        assert done["result"]["choices"][0]["finish_reason"] == expected.finish_reason == "length"
        assert done["timings"]["total_s"] >= done["timings"]["queue_wait_s"] >= 0
        assert http.get(job["links"]["self"]).json()["status"] == "succeeded"


def test_idempotency_key_returns_the_same_job(stack):
    api = stack.api()
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        first = http.post("/v1/jobs", json=job_body(), headers={"Idempotency-Key": "order-17"})
        again = http.post("/v1/jobs", json=job_body(), headers={"Idempotency-Key": "order-17"})
        in_body = http.post("/v1/jobs", json=job_body(idempotency_key="order-17"))
        other = http.post("/v1/jobs", json=job_body(), headers={"Idempotency-Key": "order-18"})
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"] == in_body.json()["id"]
    assert other.json()["id"] != first.json()["id"]


def test_stream_sends_every_chunk_then_done(stack):
    api = stack.api()
    stack.worker()
    with httpx.Client(base_url=api.url, headers=auth(), timeout=20) as http:
        job = http.post("/v1/jobs", json=job_body()).json()
        with http.stream("GET", job["links"]["stream"]) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse_events(response)
    chunks = [json.loads(e.data) for e in events if e.event == "chunk"]
    assert [int(e.id) for e in events if e.event == "chunk"] == [c["index"] for c in chunks]
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert events[-1].event == "done"
    done = json.loads(events[-1].data)
    assert done["status"] == "succeeded"
    assert "".join(c["text"] for c in chunks) == done["result"]["choices"][0]["text"]
    assert done["result"]["choices"][0]["text"] == echo_output(JobRequest(**job_body())).text


def test_stream_resumes_with_last_event_id(stack):
    """A client that drops after a few chunks and reconnects with Last-Event-ID gets the rest,
    each chunk once."""
    api = stack.api()
    stack.worker(step_delay_s=0.05)
    prompt = " ".join(f"w{i}" for i in range(30))
    body = job_body(prompt, sampling={"max_tokens": 30})
    with httpx.Client(base_url=api.url, headers=auth(), timeout=20) as http:
        job = http.post("/v1/jobs", json=body).json()
        with http.stream("GET", job["links"]["stream"]) as response:
            first = sse_events(response, limit=4)  # then the connection is dropped
        last_id = first[-1].id
        with http.stream("GET", job["links"]["stream"], headers={"Last-Event-ID": last_id}) as r:
            rest = sse_events(r)
    chunks = [json.loads(e.data) for e in first + rest if e.event == "chunk"]
    indices = [c["index"] for c in chunks]
    assert indices == list(range(len(indices)))  # every chunk, once, in order
    assert rest[-1].event == "done"
    assert "".join(c["text"] for c in chunks) == echo_output(JobRequest(**body)).text


def test_stream_rejects_a_bad_last_event_id(stack):
    api = stack.api()
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        job = http.post("/v1/jobs", json=job_body()).json()
        bad = http.get(job["links"]["stream"], headers={"Last-Event-ID": "abc"})
    assert bad.status_code == 422
    assert bad.json()["error"]["param"] == "Last-Event-ID"


def test_cancel_queued_and_running_jobs(stack):
    api = stack.api()
    with httpx.Client(base_url=api.url, headers=auth(), timeout=20) as http:
        queued = http.post("/v1/jobs", json=job_body()).json()
        cancelled = http.delete(f"/v1/jobs/{queued['id']}")
        assert cancelled.status_code == 200
        assert cancelled.json()["status"] == "cancelled"
        assert cancelled.json()["error"]["code"] == "cancelled"
        worker = stack.worker(step_delay_s=0.1)
        long_prompt = " ".join(f"w{i}" for i in range(50))
        running = http.post("/v1/jobs", json=job_body(long_prompt, sampling={"max_tokens": 50}))
        job_id = running.json()["id"]
        with http.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
            sse_events(response, limit=2)  # it runs
        assert http.delete(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
        final = http.get(f"/v1/jobs/{job_id}/wait", params={"timeout": 5}).json()
    assert final["status"] == "cancelled"
    assert queued["id"] not in worker.served  # a cancelled queued job never reaches a worker


def test_wait_returns_the_job_as_it_stands_after_the_timeout(stack):
    api = stack.api()
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        job = http.post("/v1/jobs", json=job_body()).json()
        waited = http.get(f"/v1/jobs/{job['id']}/wait", params={"timeout": 0.3})
    assert waited.status_code == 200
    assert waited.json()["status"] == "queued"


def test_auth_required_and_jobs_isolated_per_key(stack):
    api = stack.api()
    with httpx.Client(base_url=api.url) as http:
        missing = http.post("/v1/jobs", json=job_body())
        assert missing.status_code == 401
        assert missing.headers["WWW-Authenticate"] == "Bearer"
        assert missing.json()["error"]["code"] == "unauthorized"
        wrong = http.get("/v1/models", headers=auth("sk-wrong"))
        assert wrong.status_code == 401
        job = http.post("/v1/jobs", json=job_body(), headers=auth(ALICE_KEY)).json()
        base = f"/v1/jobs/{job['id']}"
        for method, path in [
            ("GET", base),
            ("GET", base + "/wait"),
            ("GET", base + "/stream"),
            ("DELETE", base),
        ]:
            response = http.request(method, path, headers=auth(BOB_KEY))
            assert response.status_code == 404, (method, path)
            assert response.json()["error"]["code"] == "not_found"
        assert http.get(base, headers=auth(ALICE_KEY)).json()["status"] == "queued"


def test_queue_limit_gives_429_with_retry_after(stack):
    api = stack.api(queue_limits={MODEL: 2}, retry_after_s=7)
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        for _ in range(2):
            assert http.post("/v1/jobs", json=job_body()).status_code == 202
        refused = http.post("/v1/jobs", json=job_body())
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "7"
    assert refused.json()["error"]["code"] == "queue_full"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi"}, "model"),
        ({"model": MODEL, "prompt": "hi", "sampling": {"temperature": 5}}, "sampling.temperature"),
        ({"model": MODEL, "prompt": "hi", "sampling": {"n": 9}}, "sampling.n"),
        ({"model": MODEL, "prompt": "hi", "priority": "high"}, "priority"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"model": MODEL, "prompt": "hi", "surprise": 1}, "surprise"),
    ],
)
def test_validation_errors_name_the_field(stack, body, param):
    api = stack.api(max_n=4)
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        response = http.post("/v1/jobs", json=body)
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert error["param"] == param
    assert param.split(".")[-1] in error["message"]


def test_malformed_json_and_oversized_bodies_are_4xx(stack):
    api = stack.api(max_body_bytes=2048)
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        broken = http.post(
            "/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"}
        )
        huge = http.post("/v1/jobs", json=job_body("word " * 1000))

        def chunked():
            yield json.dumps(job_body("word " * 1000)).encode()

        huge_chunked = http.post(
            "/v1/jobs", content=chunked(), headers={"Content-Type": "application/json"}
        )
    assert broken.status_code == 422 and "JSON" in broken.json()["error"]["message"]
    assert huge.status_code == huge_chunked.status_code == 413
    assert huge.json()["error"]["code"] == "invalid_request"


def test_unknown_model_is_404_unless_configured(stack):
    api = stack.api(models=["later-model"])
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        unknown = http.post("/v1/jobs", json={"model": "nope", "prompt": "hi"})
        configured = http.post("/v1/jobs", json={"model": "later-model", "prompt": "hi"})
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {
        "message": unknown.json()["error"]["message"],
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert configured.status_code == 202


def test_max_tokens_is_capped_by_the_model_context(stack):
    api = stack.api()
    stack.worker(max_model_len=64)
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        too_many = http.post("/v1/jobs", json=job_body(sampling={"max_tokens": 64}))
        token_prompt = http.post(
            "/v1/jobs",
            json={"model": MODEL, "prompt_token_ids": [1] * 60, "sampling": {"max_tokens": 8}},
        )
        fits = http.post("/v1/jobs", json=job_body(sampling={"max_tokens": 63}))
    assert too_many.status_code == 422
    assert too_many.json()["error"]["code"] == "context_length_exceeded"
    assert too_many.json()["error"]["param"] == "sampling.max_tokens"
    assert token_prompt.json()["error"]["code"] == "context_length_exceeded"
    assert fits.status_code == 202
