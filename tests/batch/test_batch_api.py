"""Files + Batch API end to end on the fake engine: real Redis, the API over HTTP, the arq
controller and an inference worker in-process. The fake engine's output is a pure function of
the prompt (worker_fakes.expected_output), so every line's text can be checked."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from redis import Redis
from worker_fakes import VOCAB, FakeEngine, expected_output

from schemas import RedisKeys
from tests.api.conftest import ALICE_KEY, BOB_KEY
from tests.batch.conftest import FAKE_MODEL, BatchStack

KEYS = RedisKeys()
MAX_TOKENS = 5


def completion_line(custom_id: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    body = {"model": FAKE_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    )


def expected_text(prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    return expected_output(FakeEngine().tokenize(prompt), max_tokens)[1]


def test_batch_completes_with_each_custom_id_once_and_bad_lines_in_the_error_file(
    batch_stack: BatchStack,
):
    prompts = {f"req-{i}": f"prompt number {i}" for i in range(40)}
    lines = [completion_line(cid, prompt) for cid, prompt in prompts.items()]
    lines.insert(3, "{this is not json")
    lines.insert(
        10, json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"})
    )
    lines.append(completion_line("req-0", "a duplicate custom_id"))
    lines.append(completion_line("too-many-n", "x").replace('"temperature": 0', '"n": 99'))
    uploaded = batch_stack.upload("\n".join(lines) + "\n")
    assert uploaded["object"] == "file" and uploaded["purpose"] == "batch"
    assert "4 of 44 lines are invalid" in uploaded["status_details"]
    assert batch_stack.http.get(f"/v1/files/{uploaded['id']}").json()["bytes"] == uploaded["bytes"]

    batch_stack.start_worker()
    batch_stack.start_controller()
    created = batch_stack.create(uploaded["id"], metadata={"team": "nightly"})
    assert created["status"] == "validating" and created["metadata"] == {"team": "nightly"}
    done = batch_stack.wait(created["id"], {"completed", "failed"})

    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 44, "completed": 40, "failed": 4}
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert done[stamp] >= done["created_at"]
    output = batch_stack.content(done["output_file_id"])
    assert sorted(r["custom_id"] for r in output) == sorted(prompts)
    for record in output:
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200 and record["error"] is None
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == expected_text(prompts[record["custom_id"]])
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
    errors = batch_stack.content(done["error_file_id"])
    reasons = {(e["custom_id"], e["error"]["line"]): e["error"]["message"] for e in errors}
    assert set(reasons) == {(None, 4), ("no-body", 11), ("req-0", 43), ("too-many-n", 44)}
    assert "not valid JSON" in reasons[(None, 4)]
    assert "body" in reasons[("no-body", 11)]
    assert "duplicate custom_id" in reasons[("req-0", 43)]
    assert "n" in reasons[("too-many-n", 44)]

    listed = batch_stack.http.get("/v1/batches").json()
    assert [b["id"] for b in listed["data"]] == [created["id"]]
    # another owner sees nothing of it
    bob = {"Authorization": f"Bearer {BOB_KEY}"}
    assert batch_stack.http.get(f"/v1/batches/{created['id']}", headers=bob).status_code == 404
    assert batch_stack.http.get(f"/v1/files/{uploaded['id']}", headers=bob).status_code == 404
    assert batch_stack.http.get("/v1/batches", headers=bob).json()["data"] == []


def test_chat_batch_gives_chat_completion_bodies(batch_stack: BatchStack):
    line = {
        "custom_id": "chat-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": FAKE_MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 3,
        },
    }
    uploaded = batch_stack.upload(json.dumps(line))
    batch_stack.start_worker()
    batch_stack.start_controller()
    created = batch_stack.create(uploaded["id"], endpoint="/v1/chat/completions")
    done = batch_stack.wait(created["id"], {"completed", "failed"})
    (record,) = batch_stack.content(done["output_file_id"])
    body = record["response"]["body"]
    assert body["object"] == "chat.completion"
    prompt_ids = FakeEngine().apply_chat_template([{"role": "user", "content": "hi"}])
    assert body["choices"][0]["message"]["content"] == expected_output(prompt_ids, 3)[1]
    assert done["error_file_id"] is None


@pytest.mark.parametrize(
    ("files", "data", "reason"),
    [
        ({"file": ("a.jsonl", b"{}\n")}, {"purpose": "fine-tune"}, "purpose"),
        ({"file": ("a.jsonl", b"nope\n[]\n")}, {"purpose": "batch"}, "no valid request line"),
        ({"file": ("a.jsonl", b"\n\n")}, {"purpose": "batch"}, "no request lines"),
        ({"file": ("a.jsonl", b"\xff\xfe")}, {"purpose": "batch"}, "UTF-8"),
    ],
)
def test_bad_uploads_are_400_with_a_reason(batch_stack: BatchStack, files, data, reason):
    response = batch_stack.http.post("/v1/files", files=files, data=data)
    assert response.status_code == 400
    assert reason in response.json()["error"]["message"]


def test_bad_batch_requests_are_400(batch_stack: BatchStack):
    file_id = batch_stack.upload(completion_line("a", "b"))["id"]
    cases = [
        ({"input_file_id": file_id, "endpoint": "/v1/moderations"}, "endpoint"),
        (
            {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "1y"},
            "completion_window",
        ),
        (
            {"input_file_id": "file-nonexistent0000000", "endpoint": "/v1/completions"},
            "input_file_id",
        ),
    ]
    for body, param in cases:
        response = batch_stack.http.post("/v1/batches", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    assert batch_stack.http.get("/v1/batches/batch_nonexistent000000000").status_code == 404


def test_lines_are_collected_as_their_workers_announce_the_ends(
    batch_stack: BatchStack, monkeypatch: pytest.MonkeyPatch
):
    """With the controller's sweep of every unfinished job's status pushed out to an hour, the
    batch still completes promptly: each worker announces the ends of the jobs it ran."""
    monkeypatch.setenv("INFERQ_BATCH_SWEEP_INTERVAL_S", "3600")
    prompts = {f"a-{i}": f"announced {i}" for i in range(30)}
    uploaded = batch_stack.upload("\n".join(completion_line(c, p) for c, p in prompts.items()))
    batch_stack.start_worker()
    batch_stack.start_controller()
    created = batch_stack.create(uploaded["id"])
    # well inside the controller's 30 s tick, whose next run would sweep at its start
    done = batch_stack.wait(created["id"], {"completed", "failed"}, timeout=20)
    assert done["status"] == "completed", done
    output = batch_stack.content(done["output_file_id"])
    assert sorted(r["custom_id"] for r in output) == sorted(prompts)
    redis = Redis.from_url(batch_stack.redis_url, decode_responses=True)
    assert not redis.exists(KEYS.batch_ended(created["id"]))  # retired with the batch
    redis.close()


def test_cancel_keeps_finished_results_and_runs_nothing_more(batch_stack: BatchStack):
    prompts = {f"c-{i}": f"cancel me {i}" for i in range(60)}
    uploaded = batch_stack.upload("\n".join(completion_line(c, p, 20) for c, p in prompts.items()))
    batch_stack.start_worker(step_seconds=0.02, bulk_max_held=2)
    batch_stack.start_controller()
    created = batch_stack.create(uploaded["id"])
    give_up = time.monotonic() + 60
    while batch_stack.batch(created["id"])["request_counts"]["completed"] < 3:
        assert time.monotonic() < give_up
        time.sleep(0.05)
    cancelling = batch_stack.http.post(f"/v1/batches/{created['id']}/cancel").json()
    assert cancelling["status"] in ("cancelling", "cancelled")
    done = batch_stack.wait(created["id"], {"cancelled"})
    output = batch_stack.content(done["output_file_id"])
    errors = batch_stack.content(done["error_file_id"])
    assert 3 <= len(output) < len(prompts)
    for record in output:
        text = record["response"]["body"]["choices"][0]["text"]
        assert text == expected_text(prompts[record["custom_id"]], 20)
    # every line is accounted for exactly once: done, or not run because of the cancel
    assert sorted(r["custom_id"] for r in output + errors) == sorted(prompts)
    assert {e["error"]["code"] for e in errors} <= {"batch_cancelled", "cancelled"}
    assert done["request_counts"]["completed"] == len(output)
    # nothing of the batch is left queued, and no more of its jobs run afterwards
    redis = Redis.from_url(batch_stack.redis_url, decode_responses=True)
    assert redis.xlen(KEYS.bulk_stream(FAKE_MODEL)) == 0
    time.sleep(1.0)
    succeeded = [
        k
        for k in redis.scan_iter(KEYS.job_key_prefix() + "*")
        if redis.hget(k, "status") == "succeeded"
    ]
    assert len(succeeded) == len(output)
    assert batch_stack.http.post(f"/v1/batches/{created['id']}/cancel").status_code == 200
    redis.close()


def test_completion_window_expiry_keeps_nothing_running(batch_stack: BatchStack):
    uploaded = batch_stack.upload("\n".join(completion_line(f"e-{i}", f"p {i}") for i in range(5)))
    batch_stack.start_controller()  # no inference worker: nothing can finish in time
    created = batch_stack.create(uploaded["id"], completion_window="2s")
    done = batch_stack.wait(created["id"], {"expired"}, timeout=30)
    assert done["expired_at"] >= done["expires_at"]
    assert done["output_file_id"] is None
    errors = batch_stack.content(done["error_file_id"])
    assert sorted(e["custom_id"] for e in errors) == [f"e-{i}" for i in range(5)]
    assert {e["error"]["code"] for e in errors} <= {"batch_expired", "cancelled"}
    redis = Redis.from_url(batch_stack.redis_url, decode_responses=True)
    assert redis.xlen(KEYS.bulk_stream(FAKE_MODEL)) == 0
    assert not redis.smembers(KEYS.active_batches())
    redis.close()


def test_the_official_openai_client_runs_a_batch(batch_stack: BatchStack):
    import openai

    prompts = {f"sdk-{i}": f"sdk prompt {i}" for i in range(5)}
    text = "\n".join(completion_line(c, p) for c, p in prompts.items())
    batch_stack.start_worker()
    batch_stack.start_controller()
    with openai.OpenAI(
        base_url=batch_stack.api.url + "/v1", api_key=ALICE_KEY, max_retries=0
    ) as client:
        uploaded = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
        assert client.files.retrieve(uploaded.id).bytes == len(text.encode())
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        give_up = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < give_up
            time.sleep(0.1)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 5
        output = client.files.content(batch.output_file_id).text
        assert [b.id for b in client.batches.list().data] == [batch.id]
        listed = {f.id for f in client.files.list()}
        assert listed == {uploaded.id, batch.output_file_id}
        assert client.files.delete(uploaded.id).deleted
        assert [f.id for f in client.files.list()] == [batch.output_file_id]
    texts = {
        r["custom_id"]: r["response"]["body"]["choices"][0]["text"]
        for r in map(json.loads, output.splitlines())
    }
    assert texts == {c: expected_text(p) for c, p in prompts.items()}


def test_file_uploads_have_their_own_size_limit(batch_stack: BatchStack):
    """A batch file may be far larger than any JSON request; the file cap bounds it, not the
    body limit of the other routes."""
    api = batch_stack.stack.api(models=[FAKE_MODEL], max_body_bytes=2048, max_file_bytes=64_000)
    lines = "\n".join(completion_line(f"r{i}", "x" * 50) for i in range(100)).encode()
    assert 2048 < len(lines) < 64_000
    headers = {"Authorization": f"Bearer {ALICE_KEY}"}
    with httpx.Client(base_url=api.url, headers=headers, timeout=30) as http:
        upload = http.post(
            "/v1/files", files={"file": ("a.jsonl", lines)}, data={"purpose": "batch"}
        )
        assert upload.status_code == 200, upload.text
        too_big = http.post(
            "/v1/files", files={"file": ("a.jsonl", lines * 20)}, data={"purpose": "batch"}
        )
        assert too_big.status_code == 413
        job = http.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "x" * 4096})
        assert job.status_code == 413  # other routes keep the body limit


def test_malformed_batch_bodies_are_openai_400s(batch_stack: BatchStack):
    response = batch_stack.http.post("/v1/batches", json={"endpoint": 7})
    assert response.status_code == 400
    assert response.json()["error"]["param"] is not None


def test_files_are_listed_and_deleted_but_not_while_a_batch_reads_them(batch_stack: BatchStack):
    http = batch_stack.http
    bob = {"Authorization": f"Bearer {BOB_KEY}"}
    first = batch_stack.upload(completion_line("a", "first file") + "\n")
    second = batch_stack.upload(completion_line("b", "second file") + "\n")
    bobs = http.post(
        "/v1/files",
        files={"file": ("b.jsonl", completion_line("c", "bob's").encode())},
        data={"purpose": "batch"},
        headers=bob,
    ).json()

    listed = http.get("/v1/files").json()
    assert listed["object"] == "list" and not listed["has_more"]
    assert {f["id"] for f in listed["data"]} == {first["id"], second["id"]}
    assert [f["id"] for f in http.get("/v1/files", headers=bob).json()["data"]] == [bobs["id"]]
    assert http.get("/v1/files", params={"purpose": "batch_output"}).json()["data"] == []
    page = http.get("/v1/files", params={"limit": 1}).json()
    rest = http.get("/v1/files", params={"limit": 1, "after": page["last_id"]}).json()
    assert page["has_more"] and not rest["has_more"]
    assert {page["last_id"], rest["last_id"]} == {first["id"], second["id"]}
    assert http.get("/v1/files", params={"order": "sideways"}).status_code == 400

    created = batch_stack.create(first["id"])  # no controller yet: it stays validating
    refused = http.delete(f"/v1/files/{first['id']}")
    assert refused.status_code == 409 and created["id"] in refused.json()["error"]["message"]
    assert http.delete(f"/v1/files/{first['id']}", headers=bob).status_code == 404
    deleted = http.delete(f"/v1/files/{second['id']}")
    assert deleted.json() == {"id": second["id"], "object": "file", "deleted": True}
    assert http.get(f"/v1/files/{second['id']}").status_code == 404
    assert http.delete(f"/v1/files/{second['id']}").status_code == 404
    assert [f["id"] for f in http.get("/v1/files").json()["data"]] == [first["id"]]

    batch_stack.start_worker()
    batch_stack.start_controller()
    done = batch_stack.wait(created["id"], {"completed", "failed"})
    assert done["status"] == "completed", done
    outputs = http.get("/v1/files", params={"purpose": "batch_output"}).json()["data"]
    assert [f["id"] for f in outputs] == [done["output_file_id"]]
    for file_id in (first["id"], done["output_file_id"]):  # a finished batch holds nothing
        assert http.delete(f"/v1/files/{file_id}").json()["deleted"] is True
    assert http.get("/v1/files").json()["data"] == []
    assert http.get(f"/v1/batches/{created['id']}").json()["status"] == "completed"


def test_lines_the_model_would_refuse_go_to_the_error_file_and_never_to_the_queue(
    batch_stack: BatchStack,
):
    def token_line(custom_id: str, ids: list[int]) -> str:
        body = {"model": FAKE_MODEL, "prompt": ids, "max_tokens": MAX_TOKENS}
        return json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
        )

    lines = [
        token_line("fits", [11, 12, 13]),
        token_line("out-of-vocab", [11, VOCAB + 5]),
        token_line("too-long", [11] * 600),  # the fake engine's context is 512
    ]
    uploaded = batch_stack.upload("\n".join(lines) + "\n")
    batch_stack.start_worker()
    redis = Redis.from_url(batch_stack.redis_url, decode_responses=True)
    give_up = time.monotonic() + 10
    while not redis.exists(KEYS.worker("fw-0")):  # the bounds come from its heartbeat
        assert time.monotonic() < give_up
        time.sleep(0.05)
    batch_stack.start_controller()
    done = batch_stack.wait(batch_stack.create(uploaded["id"])["id"], {"completed", "failed"})

    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    errors = {e["custom_id"]: e for e in batch_stack.content(done["error_file_id"])}
    assert errors["out-of-vocab"]["error"]["code"] == "invalid_token_id"
    assert errors["too-long"]["error"]["code"] == "context_length_exceeded"
    assert all(e["response"] is None for e in errors.values())  # never became jobs
    assert redis.xinfo_stream(KEYS.bulk_stream(FAKE_MODEL))["entries-added"] == 1
    assert not redis.exists(KEYS.dead_letters(FAKE_MODEL))
    redis.close()


def test_lines_with_sampling_token_ids_past_the_vocabulary_never_reach_the_queue(
    batch_stack: BatchStack,
):
    def line(custom_id: str, **extra: object) -> str:
        body = {"model": FAKE_MODEL, "prompt": [11, 12], "max_tokens": MAX_TOKENS, **extra}
        return json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
        )

    lines = [
        line("fits", logit_bias={"11": 5}, allowed_token_ids=[11, 12]),
        line("bias-past-vocab", logit_bias={str(VOCAB + 3): 5}),
        line("allowed-past-vocab", allowed_token_ids=[11, VOCAB]),
    ]
    uploaded = batch_stack.upload("\n".join(lines) + "\n")
    batch_stack.start_worker()
    redis = Redis.from_url(batch_stack.redis_url, decode_responses=True)
    give_up = time.monotonic() + 10
    while not redis.exists(KEYS.worker("fw-0")):  # the bounds come from its heartbeat
        assert time.monotonic() < give_up
        time.sleep(0.05)
    batch_stack.start_controller()
    done = batch_stack.wait(batch_stack.create(uploaded["id"])["id"], {"completed", "failed"})

    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    errors = {e["custom_id"]: e for e in batch_stack.content(done["error_file_id"])}
    assert "body.logit_bias" in errors["bias-past-vocab"]["error"]["message"]
    assert "body.allowed_token_ids" in errors["allowed-past-vocab"]["error"]["message"]
    assert all(e["response"] is None for e in errors.values())  # never became jobs
    assert redis.xinfo_stream(KEYS.bulk_stream(FAKE_MODEL))["entries-added"] == 1
    redis.close()
