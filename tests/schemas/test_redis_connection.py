"""Where Redis is: one set of settings (URL or Sentinels, replicas to wait for) that every
process reads from the same variables and flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from producer_api.batches.settings import BatchControllerSettings
from producer_api.settings import ApiSettings
from schemas.redis_connection import (
    MasterLogin,
    RedisConnectionSettings,
    ReplicaWait,
    parse_sentinels,
)
from worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[2]
SENTINELS = "10.0.0.1:26379, 10.0.0.2:26380,[::1]:26381"


def test_sentinel_list_parses_hosts_ports_and_ipv6():
    assert parse_sentinels(SENTINELS) == [
        ("10.0.0.1", 26379),
        ("10.0.0.2", 26380),
        ("::1", 26381),
    ]


@pytest.mark.parametrize("bad", ["host", "host:port", "host:0", ":26379", "h:99999"])
def test_a_bad_sentinel_list_is_refused_naming_the_field_and_item(bad):
    with pytest.raises(ValidationError) as caught:
        RedisConnectionSettings(redis_sentinels=f"ok:1,{bad}")
    assert "redis_sentinels" in str(caught.value) and repr(bad) in str(caught.value)


def test_a_sentinel_list_of_only_commas_is_refused():
    with pytest.raises(ValueError, match="no host:port"):
        parse_sentinels(" , ")


def test_every_process_reads_the_sentinels_from_the_same_variables(monkeypatch):
    monkeypatch.setenv("INFERQ_REDIS_SENTINELS", SENTINELS)
    monkeypatch.setenv("INFERQ_REDIS_MASTER_NAME", "prod")
    monkeypatch.setenv("INFERQ_REDIS_WAIT_REPLICAS", "1")
    monkeypatch.setenv("INFERQ_REDIS_WAIT_TIMEOUT_MS", "250")
    monkeypatch.setenv("INFERQ_REDIS_URL", "redis://app:s%40cret@ignored:6379/3")
    for settings in (ApiSettings(auth_disabled=True), WorkerSettings(), BatchControllerSettings()):
        assert settings.uses_sentinel
        assert settings.sentinel_addresses()[0] == ("10.0.0.1", 26379)
        assert settings.redis_master_name == "prod"
        assert settings.replica_wait() == ReplicaWait(1, 250)
        assert settings.master_login() == MasterLogin(db=3, username="app", password="s@cret")
        assert "s@cret" not in settings.describe() and "prod" in settings.describe()


def test_a_plain_url_waits_for_no_replica_by_default():
    settings = RedisConnectionSettings()
    assert not settings.uses_sentinel and settings.sentinel_addresses() == []
    assert settings.replica_wait() is None
    assert RedisConnectionSettings(redis_sentinels="  ").redis_sentinels is None


def test_a_url_that_is_not_redis_is_refused():
    with pytest.raises(ValidationError, match="redis_url"):
        RedisConnectionSettings(redis_url="http://127.0.0.1:6379")


@pytest.mark.parametrize("command", ["api", "worker"])
def test_the_commands_take_the_sentinel_flags(command):
    result = subprocess.run(
        [sys.executable, "-m", "cli", command, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = " ".join(result.stdout.split())
    for flag in ("--redis-sentinels", "--redis-master-name", "--redis-wait-replicas"):
        assert flag in text
    assert "env INFERQ_REDIS_SENTINELS" in text
