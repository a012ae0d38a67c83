"""What the queue functions (producer_api.queue) raise: QueueError, carrying the ErrorBody the API
sends back, with QueueFullError and JobNotFoundError; and REDIS_UNAVAILABLE, the exceptions
that mean Redis is away rather than that it refused.
"""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from redis_io.clients import CLUSTER_AWAY
from schemas import ErrorBody, ErrorCode

# What Redis being away (down, restarting, unreachable, or a master demoted by a failover that
# now answers READONLY) raises from these functions; OSError covers the socket errors that
# reach us unwrapped.
REDIS_UNAVAILABLE: tuple[type[Exception], ...] = (
    *CLUSTER_AWAY,
    RedisConnectionError,
    RedisTimeoutError,
    RedisReadOnlyError,
    OSError,
)


class QueueError(Exception):
    """A refusal or failure with the ErrorBody the API sends back."""

    def __init__(self, error: ErrorBody) -> None:
        super().__init__(error.message)
        self.error = error

    @property
    def code(self) -> ErrorCode:
        return self.error.code


class QueueFullError(QueueError):
    def __init__(self, model: str, backlog: int, limit: int) -> None:
        super().__init__(
            ErrorBody.of(
                ErrorCode.QUEUE_FULL,
                f"model: the queue of {model!r} holds {backlog} jobs (limit {limit}); retry later",
                "model",
            )
        )
        self.backlog = backlog
        self.limit = limit


class JobNotFoundError(QueueError):
    def __init__(self, job_id: str) -> None:
        super().__init__(ErrorBody.of(ErrorCode.NOT_FOUND, f"no job {job_id!r}"))
        self.job_id = job_id
