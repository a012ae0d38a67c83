"""Defaults every inferq process agrees on without importing each other: the model served
when none is named, and where Redis answers when no URL is given."""

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
