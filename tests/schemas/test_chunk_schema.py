"""TokenChunk and channel messages: compact lossless JSON, validation, replay-stream ids."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from schemas import (
    LOGPROB_FLOOR,
    ControlMessage,
    JobStatus,
    StatusEvent,
    TokenChunk,
    chunk_index_from_stream_id,
    chunk_stream_id,
    error_from_validation,
    new_job_id,
    parse_channel_message,
    replay_start_after,
)
from tests.schemas.strategies import token_chunks

JOB = new_job_id()


@settings(max_examples=80, deadline=None)
@given(token_chunks())
def test_chunk_json_round_trip_is_lossless(chunk):
    wire = chunk.to_json()
    assert TokenChunk.from_json(wire) == chunk
    assert parse_channel_message(wire) == chunk
    assert parse_channel_message(wire.encode()) == chunk


@settings(max_examples=80, deadline=None)
@given(token_chunks())
def test_chunk_json_leaves_out_defaults(chunk):
    sent = json.loads(chunk.to_json())
    full = json.loads(chunk.model_dump_json())
    defaults = TokenChunk(job_id=chunk.job_id, index=chunk.index)
    for name in full:
        is_default = getattr(chunk, name) == getattr(defaults, name) and name not in (
            "job_id",
            "index",
        )
        assert (name not in sent) == is_default, name


def test_minimal_chunk_is_small():
    wire = TokenChunk(job_id=JOB, index=12, text="hi", token_ids=[5]).to_json()
    assert set(json.loads(wire)) == {"job_id", "index", "text", "token_ids"}
    assert " " not in wire


BAD = [
    ("job_id", ""),
    ("index", -1),
    ("index", "3"),
    ("index", 1.0),
    ("choice", -1),
    ("text", 5),
    ("token_ids", [-2]),
    ("token_ids", ["1"]),
    ("logprobs", [{"token_id": 1}]),
    ("logprobs", [{"token_id": 1, "logprob": math.nan}]),
    ("logprobs", [{"token_id": 1, "logprob": -0.1, "rank": 1}]),
    ("finish_reason", "done"),
    ("stop_reason", -1),
    ("final", "maybe"),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=lambda v: repr(v)[:30])
def test_bad_chunk_field_is_rejected_naming_it(field, value):
    data = {"job_id": JOB, "index": 0, "token_ids": [1], "finish_reason": "stop", field: value}
    with pytest.raises(ValidationError) as info:
        TokenChunk.model_validate(data)
    assert error_from_validation(info.value).param.split(".")[0] == field


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"token_ids": [1, 2], "logprobs": [{"token_id": 1, "logprob": -1.0}]}, "logprobs"),
        ({"final": True}, "finish_reason"),
        ({"stop_reason": "\n"}, "stop_reason"),
    ],
)
def test_inconsistent_chunks_are_rejected(fields, named):
    with pytest.raises(ValidationError, match=named):
        TokenChunk(job_id=JOB, index=0, **fields)


def test_unknown_chunk_field_is_rejected():
    with pytest.raises(ValidationError) as info:
        TokenChunk.model_validate({"job_id": JOB, "index": 0, "delta": "x"})
    assert error_from_validation(info.value).param == "delta"


def test_minus_infinity_logprob_is_stored_as_the_floor():
    chunk = TokenChunk(
        job_id=JOB,
        index=0,
        token_ids=[3],
        logprobs=[
            {
                "token_id": 3,
                "logprob": -math.inf,
                "top_logprobs": [{"token_id": 4, "logprob": -math.inf}],
            }
        ],
    )
    back = TokenChunk.from_json(chunk.to_json())
    assert back.logprobs[0].logprob == LOGPROB_FLOOR
    assert back.logprobs[0].top_logprobs[0].logprob == LOGPROB_FLOOR


@given(st.integers(0, 10**9))
def test_stream_ids_encode_the_chunk_index(index):
    entry = chunk_stream_id(index)
    assert chunk_index_from_stream_id(entry) == index
    assert chunk_index_from_stream_id(entry.encode()) == index
    # XRANGE from replay_start_after(k) must begin exactly at chunk k + 1
    assert replay_start_after(index - 1) == entry


def test_stream_id_rejects_negative_index():
    with pytest.raises(ValueError):
        chunk_stream_id(-1)


@pytest.mark.parametrize("status", list(JobStatus))
def test_status_event_is_told_apart_from_chunks(status):
    event = StatusEvent(job_id=JOB, status=status)
    wire = event.to_json()
    assert json.loads(wire)["event"] == "status"
    assert parse_channel_message(wire) == event


@pytest.mark.parametrize("garbage", ["", "[]", "{}", '{"event":"party","job_id":"x"}', "not json"])
def test_garbage_on_the_channel_raises_value_error(garbage):
    with pytest.raises(ValueError):
        parse_channel_message(garbage)


def test_control_message_round_trip():
    message = ControlMessage(op="cancel", job_id=JOB)
    assert ControlMessage.from_json(message.to_json()) == message
    with pytest.raises(ValidationError):
        ControlMessage.from_json('{"op":"explode","job_id":"x"}')
