"""The API warns once at start-up when Redis could drop jobs' keys or grow without bound."""

from __future__ import annotations

import logging

import pytest
import redis as sync_redis

from producer_api.app import create_app
from producer_api.settings import ApiSettings

pytestmark = pytest.mark.anyio

CONFIGS = {
    "no maxmemory": ({"maxmemory": "0", "maxmemory-policy": "noeviction"}, "no maxmemory"),
    "evicting": ({"maxmemory": "64mb", "maxmemory-policy": "allkeys-lru"}, "allkeys-lru"),
    "capped, noeviction": ({"maxmemory": "64mb", "maxmemory-policy": "noeviction"}, None),
}


def configure(url: str, config: dict[str, str]) -> None:
    with sync_redis.Redis.from_url(url) as client:
        for name, value in config.items():
            client.config_set(name, value)


async def start_and_stop_api(url: str) -> None:
    app = create_app(ApiSettings(redis_url=url, api_keys={"alice": "sk-alice"}))
    async with app.router.lifespan_context(app):
        pass


@pytest.mark.parametrize("case", CONFIGS)
async def test_start_up_warns_about_unsafe_redis_memory_settings(redis_server, caplog, case):
    config, expected = CONFIGS[case]
    configure(redis_server.url, config)
    with caplog.at_level(logging.INFO, "producer_api"):
        await start_and_stop_api(redis_server.url)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if expected is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and expected in warnings[0]


async def test_start_up_does_not_wait_for_redis(caplog):
    with caplog.at_level(logging.INFO, "producer_api"):
        await start_and_stop_api("redis://127.0.0.1:1/0")  # nothing listens there
    assert any("could not check" in r.getMessage() for r in caplog.records)
    assert all(r.levelno < logging.WARNING for r in caplog.records)
