"""Redis key names, the status-transition script (run on a real Redis) and worker heartbeats."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from schemas import (
    ALLOWED_FROM,
    TERMINAL_STATUSES,
    TRANSITION_SCRIPT,
    Job,
    JobRequest,
    JobStatus,
    RedisKeys,
    StatusEvent,
    WorkerInfo,
    can_transition,
    new_job_id,
    parse_channel_message,
    transition_applied,
    transition_call,
    utc_now,
)
from schemas.keys import RESULT_TTL_S, decode_segment

KEYS = RedisKeys()
any_name = st.text(min_size=1, max_size=30)


def _all_job_keys(keys: RedisKeys, job_id: str) -> list[str]:
    return [keys.job(job_id), keys.out_stream(job_id), keys.channel(job_id)]


def test_default_layout_matches_the_architecture():
    job_id = new_job_id()
    assert KEYS.jobs_stream("SmolLM2-135M-Instruct") == "inferq:jobs:SmolLM2-135M-Instruct"
    assert _all_job_keys(KEYS, job_id) == [
        f"inferq:{kind}:{job_id}" for kind in ("job", "out", "chan")
    ]
    assert KEYS.dead_letters("m") == "inferq:dead:m"
    assert KEYS.worker("w-1") == "inferq:worker:w-1"
    assert KEYS.control_channel() == "inferq:control"
    assert KEYS.group == "workers"
    assert KEYS.job(job_id) == KEYS.job_key_prefix() + job_id


@given(any_name)
def test_model_names_are_encoded_safely_and_reversibly(model):
    key = KEYS.jobs_stream(model)
    variable = key.removeprefix("inferq:jobs:")
    assert ":" not in variable and not set("*?[] \n") & set(variable)
    assert KEYS.model_of_jobs_stream(key) == model
    assert KEYS.model_of_jobs_stream(key.encode()) == model
    assert decode_segment(KEYS.dead_letters(model).removeprefix("inferq:dead:")) == model


@given(any_name, any_name)
def test_different_names_never_share_a_key(a, b):
    if a != b:
        assert KEYS.jobs_stream(a) != KEYS.jobs_stream(b)
        assert KEYS.worker(a) != KEYS.worker(b)


@given(st.tuples(any_name, any_name), st.tuples(any_name, any_name))
def test_idempotency_keys_separate_owners(first, second):
    if first != second:
        assert KEYS.idempotency(first[1], first[0]) != KEYS.idempotency(second[1], second[0])


def test_anonymous_idempotency_is_its_own_namespace():
    assert KEYS.idempotency("k") == KEYS.idempotency("k", None)
    assert KEYS.idempotency("k") != KEYS.idempotency("k", "alice")


def test_prefix_is_configurable_and_validated():
    keys = RedisKeys("tenant-a:inferq")
    assert keys.job("job_x").startswith("tenant-a:inferq:job:")
    assert keys.jobs_stream_pattern() == "tenant-a:inferq:jobs:*"
    for bad in ["", ":x", "x:", "a b", "pre*fix", "a::b"]:
        with pytest.raises(ValueError, match="prefix"):
            RedisKeys(bad)
    with pytest.raises(ValueError):
        keys.model_of_jobs_stream("inferq:jobs:m")


def test_transition_table():
    for status in TERMINAL_STATUSES:
        assert not any(status in sources for sources in ALLOWED_FROM.values())
    assert not ALLOWED_FROM[JobStatus.QUEUED]
    assert can_transition(JobStatus.QUEUED, JobStatus.RUNNING)
    assert can_transition(JobStatus.RUNNING, JobStatus.RUNNING)
    assert not can_transition(JobStatus.QUEUED, JobStatus.SUCCEEDED)


@pytest.fixture
def client(redis_url):
    connection = redis.Redis.from_url(redis_url, decode_responses=True)
    yield connection
    connection.close()


def _stored_job(client: redis.Redis, status: JobStatus) -> Job:
    job = Job.new(JobRequest(model="m", prompt="p")).model_copy(update={"status": status})
    client.hset(KEYS.job(job.id), mapping=job.to_redis_hash())
    return job


@pytest.mark.parametrize("current", list(JobStatus))
def test_transition_script_applies_exactly_the_allowed_changes(client, current):
    for new in JobStatus:
        job = _stored_job(client, current)
        listener = client.pubsub()
        listener.subscribe(KEYS.channel(job.id))
        assert listener.get_message(timeout=2)["type"] == "subscribe"
        finished = datetime(2030, 1, 1, tzinfo=UTC)
        keys_, args = transition_call(KEYS, job.id, new, {"finished_at": finished, "worker": "w9"})
        applied, previous = transition_applied(client.eval(TRANSITION_SCRIPT, 2, *keys_, *args))
        assert previous is current
        assert applied == can_transition(current, new)
        stored = Job.from_redis_hash(client.hgetall(KEYS.job(job.id)))
        if applied:
            assert stored.status is new and stored.worker == "w9" and stored.finished_at == finished
        else:
            assert stored == job
        ttl = client.ttl(KEYS.job(job.id))
        assert (0 < ttl <= RESULT_TTL_S) == (applied and new.is_terminal)
        expect_event = applied and new.is_terminal
        message = listener.get_message(timeout=2 if expect_event else 0.05)
        if expect_event:
            assert parse_channel_message(message["data"]) == StatusEvent(job_id=job.id, status=new)
        else:
            assert message is None
        listener.close()


def test_only_failed_replaces_a_status_that_is_no_status(client):
    """A corrupt writer's status (no JobStatus value) can only end as failed."""
    for new in JobStatus:
        job = _stored_job(client, JobStatus.QUEUED)
        client.hset(KEYS.job(job.id), "status", "banana")
        keys_, args = transition_call(KEYS, job.id, new, {"worker": "w9"})
        applied, previous = transition_applied(client.eval(TRANSITION_SCRIPT, 2, *keys_, *args))
        assert applied == (new is JobStatus.FAILED)
        assert previous is None
        expected = new.value if applied else "banana"
        assert client.hget(KEYS.job(job.id), "status") == expected


def test_transition_of_a_missing_job_reports_none(client):
    keys_, args = transition_call(KEYS, new_job_id(), JobStatus.CANCELLED)
    assert transition_applied(client.eval(TRANSITION_SCRIPT, 2, *keys_, *args)) == (False, None)


def test_worker_info_hash_round_trip():
    info = WorkerInfo(
        name="gpu-0",
        model="SmolLM2-135M-Instruct",
        kv_blocks_free=10,
        kv_blocks_total=64,
        running=3,
        waiting=1,
        version="0.1.0",
        quantization="gguf",
        weight_bytes=123_456_789,
        started_at=utc_now(),
        updated_at=utc_now(),
    )
    flat = info.to_redis_hash()
    assert all(isinstance(v, str) for v in flat.values())
    assert WorkerInfo.from_redis_hash({k.encode(): v.encode() for k, v in flat.items()}) == info


def test_a_heartbeat_without_quantization_reads_as_full_precision():
    """A worker from before the quantization fields, or one running full precision, writes
    neither field: its heartbeat still parses, with None for both."""
    now = utc_now()
    full = WorkerInfo(name="w", model="m", kv_blocks_free=1, kv_blocks_total=2, started_at=now,
                      updated_at=now)  # fmt: skip
    flat = full.to_redis_hash()
    assert "quantization" not in flat and "weight_bytes" not in flat
    old = WorkerInfo.from_redis_hash(flat)
    assert (old.quantization, old.weight_bytes) == (None, None)
