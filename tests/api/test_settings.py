"""API settings and key handling: keys are kept hashed, auth must be configured explicitly."""

from __future__ import annotations

import hashlib
import json

import pytest
from pydantic import ValidationError

from producer_api.auth import KeyTable, bearer_token, hash_api_key
from producer_api.settings import ApiSettings


def test_bare_keys_are_hashed_and_hashes_kept(monkeypatch):
    keys = {"alice": "sk-a", "bob": hash_api_key("sk-b")}
    monkeypatch.setenv("INFERQ_API_KEYS", json.dumps(keys))
    settings = ApiSettings()
    assert settings.api_keys["alice"] == "sha256:" + hashlib.sha256(b"sk-a").hexdigest()
    assert "sk-a" not in repr(settings)
    table = settings.key_table()
    assert (table.owner_of("sk-a"), table.owner_of("sk-b"), table.owner_of("sk-c")) == (
        "alice",
        "bob",
        None,
    )


def test_some_auth_must_be_configured(monkeypatch):
    monkeypatch.delenv("INFERQ_API_KEYS", raising=False)
    monkeypatch.delenv("INFERQ_AUTH_DISABLED", raising=False)
    with pytest.raises(ValidationError, match="INFERQ_AUTH_DISABLED"):
        ApiSettings()
    monkeypatch.setenv("INFERQ_AUTH_DISABLED", "1")
    assert ApiSettings().auth_disabled


def test_bearer_header_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None
    assert KeyTable.from_hashes({}).owner_of("x") is None
