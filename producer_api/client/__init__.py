"""Python clients for backend apps."""

from producer_api.client.redis_client import AsyncRedisClient, RedisClient

__all__ = ["AsyncRedisClient", "RedisClient"]
