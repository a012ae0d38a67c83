"""A full Redis (maxmemory reached under noeviction) refuses new jobs: the API answers 503 with
Retry-After, as when Redis is down, instead of a 500."""

from __future__ import annotations

import httpx
import pytest
import redis as sync_redis

from producer_api.app import create_app
from producer_api.settings import ApiSettings
from schemas.defaults import DEFAULT_MODEL

pytestmark = pytest.mark.anyio

KEY = "sk-alice"


async def test_enqueue_into_a_full_redis_is_a_503_with_retry_after(redis_server):
    app = create_app(
        ApiSettings(redis_url=redis_server.url, api_keys={"alice": KEY}, models=[DEFAULT_MODEL])
    )
    async with app.router.lifespan_context(app):
        with sync_redis.Redis.from_url(redis_server.url) as admin:
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set(
                "maxmemory", "1"
            )  # below what Redis already uses: every write is refused
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            response = await client.post(
                "/v1/jobs",
                json={"model": DEFAULT_MODEL, "prompt": "Hi", "sampling": {"max_tokens": 4}},
                headers={"Authorization": f"Bearer {KEY}"},
            )
    assert response.status_code == 503
    assert int(response.headers["Retry-After"]) > 0
    error = response.json()["error"]
    assert error["code"] == "unavailable"
    assert "full" in error["message"]
