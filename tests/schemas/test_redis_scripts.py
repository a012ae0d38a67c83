"""The Lua scripts in `schemas.redis_scripts`: every name they use comes from the enums, they
compile, and the batch and lease scripts behave (the job scripts are exercised through their
callers in tests/producer_api, tests/worker and test_redis_names.py)."""

from __future__ import annotations

import inspect
import re

import pytest
import redis

from schemas import BatchField, BatchStatus, JobField, JobStatus, RedisKeys, redis_scripts
from schemas.keys import JOB_ENTRY_FIELD
from schemas.redis_scripts import (
    ALL_SCRIPTS,
    BATCH_SET_STATUS_SCRIPT,
    BATCH_STATUS_ARGS_END,
    LEASE_RELEASE_SCRIPT,
    LEASE_RENEW_SCRIPT,
    PLACEHOLDERS,
    EnqueueOutcome,
)
from schemas.transitions import UNKNOWN_STATUS_SOURCE

# Redis commands and their keyword arguments the scripts call.
REDIS_WORDS = frozenset(
    {
        "COUNT",
        "DEL",
        "EX",
        "EXISTS",
        "EXPIRE",
        "GET",
        "GROUP",
        "HGET",
        "HDEL",
        "HINCRBY",
        "HSET",
        "MAXLEN",
        "PERSIST",
        "PEXPIRE",
        "PUBLISH",
        "SET",
        "STREAMS",
        "TIME",
        "XACK",
        "XADD",
        "XCLAIM",
        "XDEL",
        "XLEN",
        "XPENDING",
        "XREADGROUP",
        "ZADD",
        "ZRANGEBYSCORE",
        "ZREM",
        "ZREMRANGEBYSCORE",
    }
)
# Literals that are Lua or Redis syntax, not names of the protocol: empty string, ARGV flags,
# XADD's auto id and approximate trim, XREADGROUP's never-delivered id, a gmatch pattern, a Lua
# type name, the text of Redis's refusal of a repeated stream id, sorted-set score bounds, and
# the pattern that splits a LoRA offer ("kind|entry|adapter|owner").
SYNTAX = frozenset(
    {
        *("", "0", "1", "*", "~", ">", "%S+", "table", "equal or smaller"),
        *("-inf", "+inf", "("),
        "^([jb])|([^|]+)|([^|]+)|(.*)",
    }
)
PROTOCOL_NAMES = frozenset(
    {
        *(field.value for field in JobField),
        *(status.value for status in JobStatus),
        *(field.value for field in BatchField),
        *(outcome.value for outcome in EnqueueOutcome),
        JOB_ENTRY_FIELD,
        BATCH_STATUS_ARGS_END,
        UNKNOWN_STATUS_SOURCE,
    }
)
_LUA_STRING = re.compile(r"'([^'\n]*)'")


def _quoted(text: str) -> list[str]:
    return _LUA_STRING.findall(text)


@pytest.mark.parametrize("name", sorted(ALL_SCRIPTS))
def test_every_quoted_word_is_a_redis_word_or_a_name_from_the_enums(name):
    source = ALL_SCRIPTS[name]
    assert "$" not in source, "a placeholder was left unfilled"
    unknown = [
        word for word in _quoted(source) if word not in REDIS_WORDS | SYNTAX | PROTOCOL_NAMES
    ]
    assert not unknown, f"{name} spells {unknown} that no enum or Redis command knows"


def test_scripts_spell_no_field_or_status_themselves():
    # In the module's text every field name, status and reply tag is a $PLACEHOLDER, so renaming
    # an enum value renames it in every script.
    module_text = inspect.getsource(redis_scripts)
    spelled = {word for word in _quoted(module_text) if word in PROTOCOL_NAMES}
    assert not spelled, f"write {sorted(spelled)} as $PLACEHOLDERS, not literally"


def test_placeholders_are_the_enum_values():
    assert PLACEHOLDERS["JOB_STATUS"] == JobField.STATUS.value
    assert PLACEHOLDERS["JOB_ENTRY_ID"] == JobField.ENTRY_ID.value
    assert PLACEHOLDERS["JOB_ATTEMPTS"] == JobField.ATTEMPTS.value
    assert PLACEHOLDERS["STATUS_QUEUED"] == JobStatus.QUEUED.value
    assert PLACEHOLDERS["BATCH_STATUS"] == BatchField.STATUS.value
    assert PLACEHOLDERS["ENTRY_FIELD"] == JOB_ENTRY_FIELD
    assert set(PLACEHOLDERS.values()) <= PROTOCOL_NAMES


def test_the_job_scripts_name_the_job_hash_fields_they_touch():
    assert f"'{JobField.STATUS}'" in redis_scripts.TRANSITION_SCRIPT
    assert f"'{JobField.ENTRY_ID}'" in redis_scripts.ENQUEUE_SCRIPT
    assert f"'{JOB_ENTRY_FIELD}'" in redis_scripts.ENQUEUE_SCRIPT
    handback = redis_scripts.HANDBACK_SCRIPT
    for word in (JobField.STATUS, JobField.ATTEMPTS, JobStatus.QUEUED, JobStatus.RUNNING):
        assert f"'{word}'" in handback


@pytest.fixture
def client(redis_url):
    connection = redis.Redis.from_url(redis_url, decode_responses=True)
    yield connection
    connection.close()


@pytest.mark.parametrize("name", sorted(ALL_SCRIPTS))
def test_every_script_compiles(client, name):
    assert len(client.script_load(ALL_SCRIPTS[name])) == 40


def _batch(client: redis.Redis, status: BatchStatus) -> str:
    key = RedisKeys().batch("batch_" + "a" * 16 + status.value)
    client.delete(key)
    client.hset(key, mapping={BatchField.STATUS: status.value, BatchField.TOTAL: "0"})
    return key


def test_batch_status_changes_only_from_an_allowed_status(client):
    key = _batch(client, BatchStatus.VALIDATING)
    reply = client.eval(
        BATCH_SET_STATUS_SCRIPT,
        1,
        key,
        BatchStatus.FAILED.value,
        "",
        "0",
        BatchStatus.IN_PROGRESS.value,
        BATCH_STATUS_ARGS_END,
    )
    assert reply == [0, BatchStatus.VALIDATING.value]
    assert client.hget(key, BatchField.STATUS) == BatchStatus.VALIDATING.value


def test_batch_status_change_sets_its_time_and_the_extra_fields(client):
    key = _batch(client, BatchStatus.IN_PROGRESS)
    allowed = [BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value]
    extra = [BatchField.TOTAL.value, "7", BatchField.COMPLETED.value, "5"]
    reply = client.eval(
        BATCH_SET_STATUS_SCRIPT,
        1,
        key,
        BatchStatus.COMPLETED.value,
        BatchField.COMPLETED_AT.value,
        "1700000000",
        *allowed,
        BATCH_STATUS_ARGS_END,
        *extra,
    )
    assert reply == [1, BatchStatus.IN_PROGRESS.value]
    assert client.hgetall(key) == {
        BatchField.STATUS: BatchStatus.COMPLETED.value,
        BatchField.COMPLETED_AT: "1700000000",
        BatchField.TOTAL: "7",
        BatchField.COMPLETED: "5",
    }


def test_batch_status_change_of_a_missing_batch(client):
    key = RedisKeys().batch("batch_" + "b" * 16)
    client.delete(key)
    args = [BatchStatus.CANCELLING.value, "", "0", BatchStatus.VALIDATING.value]
    assert client.eval(BATCH_SET_STATUS_SCRIPT, 1, key, *args) == [0, None]


def test_lease_is_renewed_and_released_only_by_its_holder(client):
    key = RedisKeys().batch_lease("batch_" + "c" * 16)
    client.set(key, "ours", px=10_000)
    assert client.eval(LEASE_RENEW_SCRIPT, 1, key, "theirs", 60_000) == 0
    assert client.pttl(key) <= 10_000
    assert client.eval(LEASE_RENEW_SCRIPT, 1, key, "ours", 60_000) == 1
    assert client.pttl(key) > 10_000
    assert client.eval(LEASE_RELEASE_SCRIPT, 1, key, "theirs") == 0
    assert client.get(key) == "ours"
    assert client.eval(LEASE_RELEASE_SCRIPT, 1, key, "ours") == 1
    assert client.get(key) is None
